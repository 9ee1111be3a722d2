"""Structured output against hostile specs: a spec that overflows the grammar compiler's native
stack is refused, never run where it kills the process; whatever the check passes compiles on the
engine's compile thread; deep JSON is a ValueError; constraints no output can satisfy are refused
up front, and a sample whose constraints leave no token later ends cleanly (no step fault); an
aborted request's compile is dropped; the compiled-grammar cache is bounded by memory."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from tandem.config import EngineConfig
from tandem.core.request import NO_ALLOWED_TOKEN
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import EngineCoreRequest
from tandem.engine.tokenizer import Tokenizer
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.structured.checker import GrammarChecker
from tandem.structured.config import MIB, GrammarLimits
from tandem.structured.manager import StructuredOutputManager

ENGINE = {"num_kv_blocks": 128, "num_threads": 1, "max_num_seqs": 8}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 3}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture(scope="module")
def vocab(llama_dir):
    return json.loads((llama_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def checker(llama_dir, vocab):
    # A short timeout keeps the slow chains quick to refuse.
    c = GrammarChecker(str(llama_dir), vocab, (Tokenizer(str(llama_dir)).eos_token_id or 0,), timeout_s=2.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), **ENGINE))


# Ten times the sizes that killed the API process (a Lark chain of 3,000 rules, a GBNF chain of
# 5,000, 1,000 nested $refs): on the check's stack they either compile or are refused.
@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(grammar=lark_chain(30_000)),
        StructuredOutputsParams(grammar=gbnf_chain(50_000)),
        StructuredOutputsParams(json=ref_chain(10_000)),
    ],
    ids=["lark-30k", "gbnf-50k", "ref-10k"],
)
def test_chains_ten_times_past_the_crash_leave_the_process_alive(checker, spec):
    try:
        checker.check(spec)
    except ValueError as exc:
        assert "structured_outputs." in str(exc) and "too complex" in str(exc)
    # A spec that took a check process down cost only that process.
    checker.check(StructuredOutputsParams(choice=["yes", "no"]))


def test_a_crash_and_a_timeout_are_refusals_with_reasons(checker):
    crashes, timeouts = checker.num_refused_crash, checker.num_refused_timeout
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar is too complex .* MiB of stack"):
        checker.check(StructuredOutputsParams(grammar=lark_chain(40_000)))
    assert checker.num_refused_crash == crashes + 1
    with pytest.raises(ValueError, match=r"took longer than 2.0 s to compile"):
        checker.check(StructuredOutputsParams(grammar=gbnf_chain(30_000)))
    assert checker.num_refused_timeout == timeouts + 1


def test_what_the_check_passes_compiles_on_the_engines_compile_thread(checker, llama_dir, vocab):
    """The deepest chains the check's stack takes compile on the engine's (four times larger) one;
    a crash here would take the test process down."""
    manager = StructuredOutputManager(str(llama_dir), vocab, (0,), cache_size=4)
    passed = 0
    for n in (8_000, 16_000, 20_000):
        sp = StructuredOutputsParams(grammar=lark_chain(n))
        try:
            checker.check(sp)
        except ValueError:
            continue
        passed += 1
        matcher = manager.grammar(sp).matcher()
        bitmask = np.zeros((1, manager.words), dtype=np.int32)
        matcher.fill_bitmask(bitmask, 0)
        assert bitmask.any()
    assert passed, "the check refused even the shallowest chain"
    manager.close()


def test_the_check_stack_is_a_quarter_of_the_compile_threads():
    limits = GrammarLimits()
    assert limits.compile_stack_bytes >= 4 * limits.check_stack_bytes


@pytest.mark.parametrize(
    "spec",
    [
        "[" * 5000 + "]" * 5000,
        '{"a":' * 480 + "{}" + "}" * 480,
        '{"type": "object", "description": "' + "[" * 5000 + '"}',
    ],
    ids=["arrays-5000", "dict-480", "brackets-in-a-string"],
)
def test_deep_json_is_a_value_error_not_a_recursion_error(spec):
    if "description" in spec:  # brackets inside a string do not nest
        StructuredOutputsParams(json=spec)
        return
    with pytest.raises(ValueError, match=r"structured_outputs\.json is nested more than 128 levels"):
        StructuredOutputsParams(json=spec)


def test_deep_json_as_a_dict_is_a_value_error():
    schema: dict = {}
    node = schema
    for _ in range(3000):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(ValueError, match="nested more than 128"):
        StructuredOutputsParams(json=schema)


def test_a_grammar_past_the_engines_limits_is_refused_up_front(engine):
    with pytest.raises(ValueError, match="exceeds the grammar engine's limits"):
        engine.add_request(
            "r", "x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "a" root'))
        )
    assert not engine.core.has_unfinished_requests()


def _single_token(engine: LLMEngine, text: str) -> int:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_constraints_that_exclude_every_first_token_are_refused(engine):
    a = _single_token(engine, "a")
    choice = StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match="allows no first token that allowed_token_ids"):
        engine.add_request("r1", "x", SamplingParams(structured_outputs=choice, allowed_token_ids=[a]))
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token is one of the bad_words"):
        engine.add_request("r2", "x", SamplingParams(allowed_token_ids=[a], bad_words=["a"]))
    assert not engine.core.has_unfinished_requests()


def _run(engine: LLMEngine) -> dict:
    outs = {}
    while engine.core.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def test_a_dead_end_after_the_first_token_ends_the_sample_cleanly(engine):
    """The grammar needs a "b" after some "a"s, allowed_token_ids has only "a": a later step has no
    token. Before, the all -inf row drew token 0, the matcher refused it inside the next step and
    the step faulted (bisection, a 500); now the sample ends with what it has, the others go on."""
    a = _single_token(engine, "a")
    faults = engine.counters.num_request_faults
    sp = StructuredOutputsParams(regex="a{3}b")
    engine.add_request(
        "dead", "x", SamplingParams(structured_outputs=sp, allowed_token_ids=[a], max_tokens=8)
    )
    engine.add_request("fine", "x", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outs = _run(engine)
    dead = outs["dead"].outputs[0]
    # As many "a"s as the grammar lets stand alone (llguidance keeps tokenizations canonical: the
    # last "a" before "b" must be the token "ab" where the vocabulary has one).
    assert 1 <= len(dead.token_ids) <= 3 and set(dead.token_ids) == {a}
    assert dead.text == "a" * len(dead.token_ids)
    assert dead.finish_reason == "stop" and dead.stop_reason == NO_ALLOWED_TOKEN
    assert len(outs["fine"].outputs[0].token_ids) == 6
    assert engine.counters.num_request_faults == faults
    assert engine.core.structured.num_tracked == 0


def test_a_fully_blocked_row_without_a_grammar_no_longer_emits_token_0(engine):
    """allowed_token_ids and a two-token bad word: after the first token nothing is left."""
    a = _single_token(engine, "a")
    params = SamplingParams(allowed_token_ids=[a], max_tokens=8, ignore_eos=True)
    params.bad_words_token_ids = [
        [a, a]
    ]  # the word "a a..." as tokens: its second token is blocked after one
    engine.add_request("blocked", "x", params)
    out = _run(engine)["blocked"].outputs[0]
    assert out.token_ids == [a] and 0 not in out.token_ids
    assert out.finish_reason == "stop" and out.stop_reason == NO_ALLOWED_TOKEN


def test_a_dead_end_under_speculation_keeps_the_accepted_drafts(llama_dir):
    """n-gram drafts over a repetitive prompt: the dead row may sit inside the verified span."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = LLMEngine(EngineConfig(model=str(llama_dir), speculative_config=spec, **ENGINE))
    a = _single_token(engine, "a")
    sp = StructuredOutputsParams(regex="a{3}b")
    engine.add_request(
        "r", "a a a a a a", SamplingParams(structured_outputs=sp, allowed_token_ids=[a], max_tokens=8)
    )
    out = _run(engine)["r"].outputs[0]
    plain = LLMEngine(EngineConfig(model=str(llama_dir), **ENGINE))
    plain.add_request(
        "r", "a a a a a a", SamplingParams(structured_outputs=sp, allowed_token_ids=[a], max_tokens=8)
    )
    assert out.token_ids == _run(plain)["r"].outputs[0].token_ids
    assert out.token_ids and set(out.token_ids) == {a}
    assert out.stop_reason == NO_ALLOWED_TOKEN
    assert engine.counters.num_request_faults == 0


def test_a_moved_request_whose_tokens_break_its_grammar_ends_without_a_fault(engine):
    """A matcher that refuses a token the sample already has (a moved request's, or one past the
    grammar engine's limits) leaves the sample no token: it ends, the step does not fault."""
    tok = engine.tokenizer
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"]), max_tokens=8)
    head = tok.encode("no", add_special_tokens=False)
    req = EngineCoreRequest("moved", tok.encode("x"), params, 8, 0.0, resumed_outputs=[head])
    faults = engine.counters.num_request_faults
    engine.core.add_request(req)
    finished = []
    while engine.core.has_unfinished_requests():
        finished += [so for so in engine.core.step() if so.finish_reason is not None]
    assert [(so.finish_reason, so.stop_reason, so.new_token_ids) for so in finished] == [
        ("stop", NO_ALLOWED_TOKEN, [])
    ]
    assert engine.counters.num_request_faults == faults


def test_end_dead_keeps_the_drafts_accepted_before_the_dead_row():
    from tandem.core.step_io import RunnerOutput
    from tandem.worker.model_runner import end_dead

    out = RunnerOutput(
        sampled={"r0": 9, "r1": 9, "r2": 9},
        accepted={"r0": [5, 6, 7], "r1": [5], "r2": [5, 6]},
    )
    # r0's third row (after two drafts) is dead, r1 rejected its second draft before its dead
    # row, r2's first row is dead.
    # The rows each emitted token came from: r0's four (three drafts, then one), r1's two, r2's three.
    used_rows = {"r0": [0, 1, 2, 3], "r1": [4, 5], "r2": [8, 9, 10]}
    dead = [False, False, True, False, *[False, False, True, True], *[True, False, False]]
    end_dead(dead, used_rows, out)
    assert out.dead_ends == {"r0", "r2"}
    assert out.accepted == {"r0": [5, 6], "r1": [5]}


def test_dead_rows_lift_the_masks_of_rows_with_no_token_left():
    import torch

    from tandem.worker.model_runner import dead_rows
    from tandem.worker.sampler import SamplingBatch

    blocked = torch.tensor([[True, False, True], [True, True, False], [False, False, False]])
    grammar = torch.tensor([[False, True, False], [False, False, True], [False, False, False]])
    sb = SamplingBatch(
        temperature=torch.ones(3),
        greedy=torch.ones(3, dtype=torch.bool),
        all_greedy=True,
        top_k=None,
        top_p=None,
        min_p=None,
        presence=None,
        frequency=None,
        repetition=None,
        output_counts=None,
        prompt_mask=None,
        blocked=blocked,
        generators=[None] * 3,
        num_logprobs=[None] * 3,
        grammar_forbidden=grammar,
    )
    assert dead_rows(sb) == [True, True, False]
    assert not blocked[:2].any() and not grammar[:2].any()
    assert dead_rows(sb) is None


class _SlowBackend:
    """A grammar backend whose compiles wait for `gate` and count themselves."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.compiled: list[str] = []
        self.vocab_size = 64

    def compile(self, kind: str, text: str) -> object:
        self.started.set()
        self.gate.wait(10)
        self.compiled.append(text)
        return object()


def test_an_aborted_requests_queued_compile_is_cancelled_and_a_running_one_dropped():
    manager = StructuredOutputManager("unused", 64, (0,), cache_size=8)
    backend = _SlowBackend()
    manager._backend = backend  # type: ignore[assignment]
    running = StructuredOutputsParams(regex="a+")
    queued = StructuredOutputsParams(regex="b+")
    shared = StructuredOutputsParams(regex="c+")
    f_running = manager.prepare("r1", running)
    f_queued = manager.prepare("r2", queued)
    manager.prepare("r3", shared)
    manager.prepare("r4", shared)
    assert f_running is not None and f_queued is not None
    assert backend.started.wait(10)  # "a+" is compiling, the others wait behind it
    manager.release("r2", queued)
    manager.release("r1", running)
    manager.release("r3", shared)  # r4 still waits for it
    assert f_queued.cancelled()
    assert manager.num_compiling == 1
    backend.gate.set()
    assert manager.grammar(shared) is not None
    assert backend.compiled == ["a+", "c+"]  # the queued one never ran
    assert manager.num_compiling == 0 and len(manager._cache) == 1  # the dropped one is not cached
    manager.close()


def test_an_engine_abort_while_compiling_leaves_no_compile_behind(engine):
    manager = engine.core.structured
    sp = StructuredOutputsParams(
        json={"type": "object", "properties": {"unique_name_41": {"type": "string"}}}
    )
    engine.add_request("compiling", "x", SamplingParams(structured_outputs=sp))
    assert manager.num_compiling == 1
    engine.abort_request("compiling")
    assert manager.num_compiling == 0 and not engine.core.has_unfinished_requests()


class _SizedBackend:
    vocab_size = 64

    def compile(self, kind: str, text: str) -> object:
        return object()


def test_the_grammar_cache_is_bounded_by_bytes():
    limits = GrammarLimits(bytes_per_char=1, base_bytes=0)
    manager = StructuredOutputManager("unused", 64, (0,), cache_size=100, cache_bytes=1000, limits=limits)
    manager._backend = _SizedBackend()  # type: ignore[assignment]
    for i in range(20):
        manager.grammar(StructuredOutputsParams(regex=f"{i:03d}" + "x" * 297))  # 300 characters each
        assert manager.cached_bytes <= 1000
    assert len(manager._cache) == 3
    # The most recently used stay.
    assert [text[:3] for _, text in manager._cache] == ["017", "018", "019"]
    # One grammar larger than the whole bound is kept alone (it is in use), then replaced.
    manager.grammar(StructuredOutputsParams(regex="y" * 5000))
    assert len(manager._cache) == 1
    manager.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_distinct_huge_enums_leave_memory_bounded(llama_dir, vocab):
    """160 schemas with 60k-value enums took an engine from 428 MB to 3.35 GB with a cache bounded
    by count; with the byte bound, memory stops growing once the cache is full."""
    manager = StructuredOutputManager(str(llama_dir), vocab, (0,), cache_size=128, cache_bytes=64 * MIB)
    rng = np.random.default_rng(0)

    def schema(i: int) -> StructuredOutputsParams:
        words = [f"v{i}_{w}" for w in rng.integers(0, 10**9, size=20_000)]
        return StructuredOutputsParams(json={"enum": words})

    for i in range(6):  # fill the cache
        manager.grammar(schema(i))
    full = _rss()
    for i in range(6, 30):
        manager.grammar(schema(i))
        assert manager.cached_bytes <= 64 * MIB
    grown = _rss() - full
    # Unbounded, these 24 grammars would hold ~300 MB more (about 13 MB each).
    assert grown < 120 * MIB, grown / MIB
    manager.close()
