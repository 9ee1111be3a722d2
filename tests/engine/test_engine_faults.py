"""A failing request never fails the engine, and nothing outlives a request.

- Faults injected into one request's sampling, forward or text processing fail that request alone
  (finish reason "error", the reason in `RequestOutput.error`); every other request finishes with
  exactly its fault-free greedy output. A fault every request carries is the engine's: it raises.
- A seeded churn run through `LLMEngine` (real sampler, stop strings, n > 1, aborts, speculation)
  ends with no table holding a finished request and every KV block free or evictable.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

PROMPTS = [[5, 9, 11, 13, 17], [21, 22, 23], [30, 31, 32, 33, 34, 35, 36], [40, 41], [50, 52, 54, 56]]
BAD = [7, 7, 7, 7, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    args = dict(num_kv_blocks=128, max_num_seqs=8, num_threads=1, block_size=4)
    args.update(kw)
    return LLMEngine(EngineConfig(model=str(model_dir), **args))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_nothing_held(engine: LLMEngine) -> None:
    core = engine.core
    assert core._groups == {}, core._groups
    assert engine.outputs.groups == {}
    assert not core.scheduler.has_unfinished() and core.scheduler.requests == {}
    # The runner drops a finished request's state when the next step hands it the finished ids.
    engine.core.runner.execute(core.scheduler.schedule())
    assert core.runner.generators == {}
    drafter = core.runner.drafter
    if drafter is not None:
        assert drafter.valid == {} and drafter.generators == {}
    kv = core.kv
    kv.check_invariants()
    cached = kv.cache.num_cached_blocks if kv.cache is not None else 0
    assert kv.pool.num_free + cached == kv.num_blocks, "KV blocks leaked"
    assert kv.usage == 0.0


def faulty_when(engine: LLMEngine, method: str, bad) -> None:
    """Make `engine.core.runner.<method>` raise whenever `bad(args)` says so."""
    runner = engine.core.runner
    original = getattr(runner, method)

    def wrapped(*args, **kw):
        if bad(*args):
            raise RuntimeError(f"injected fault in {method}")
        return original(*args, **kw)

    setattr(runner, method, wrapped)


def carries_bad(rows) -> bool:
    return any(row.request.prompt_token_ids[: len(BAD)] == BAD for row in rows)


@pytest.fixture(scope="module")
def reference(llama_dir):
    engine = make_engine(llama_dir)
    return {rid: out.outputs[0].token_ids for rid, out in run(engine, dict(enumerate(PROMPTS))).items()}


@pytest.mark.parametrize("where", ["sampling", "forward"])
def test_a_fault_in_one_request_fails_it_alone(llama_dir, reference, where):
    engine = make_engine(llama_dir)
    if where == "sampling":
        faulty_when(engine, "sampling_batch", carries_bad)
    else:
        model = engine.core.runner.model
        original = model.forward

        def forward(batch, caches):
            ids = batch.input_ids.tolist()
            if any(ids[i : i + len(BAD)] == BAD for i in range(len(ids))):
                raise IndexError("injected fault in the forward")
            return original(batch, caches)

        model.forward = forward
    prompts = dict(enumerate(PROMPTS))
    prompts["bad"] = BAD
    done = run(engine, prompts)
    bad = done.pop("bad")
    assert bad.finished and bad.error is not None and "injected fault" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == reference
    assert engine.core.counters.num_request_faults == 1
    assert_nothing_held(engine)
    # The engine goes on serving.
    assert run(engine, {"after": PROMPTS[0]})["after"].outputs[0].token_ids == reference[0]


def test_a_fault_fails_all_samples_of_its_request(llama_dir, reference):
    engine = make_engine(llama_dir)
    faulty_when(engine, "sampling_batch", carries_bad)
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=6)
    engine.add_request("bad", BAD, params)
    engine.add_request("good", PROMPTS[0], GREEDY)
    done = run(engine, {})
    assert [c.finish_reason for c in done["bad"].outputs] == ["error"] * 3
    assert done["good"].outputs[0].token_ids == reference[0]
    assert_nothing_held(engine)


def test_a_fault_every_request_carries_is_the_engines(llama_dir):
    engine = make_engine(llama_dir)
    faulty_when(engine, "sampling_batch", lambda rows: True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, GREEDY)
    with pytest.raises(RuntimeError, match="injected fault"):
        while engine.has_unfinished_requests():
            engine.step()


def test_a_fault_that_keeps_recurring_is_the_engines(llama_dir):
    """One request at a time cannot tell its own fault from the engine's; a fault that fails request
    after request is raised once it outlives MAX_FAULTED_STEPS of them."""
    from tandem.engine.core import MAX_FAULTED_STEPS

    engine = make_engine(llama_dir)
    faulty_when(engine, "sampling_batch", lambda rows: True)
    with pytest.raises(RuntimeError, match="injected fault"):
        for i in range(MAX_FAULTED_STEPS + 2):
            out = run(engine, {f"r{i}": PROMPTS[0]})
            assert out[f"r{i}"].error is not None


def test_a_fault_in_text_processing_fails_that_request_alone(llama_dir, reference):
    engine = make_engine(llama_dir)
    original = engine.outputs._apply

    def apply(group, sample, up, now, stops):
        if group.request_id == "bad" and len(sample.token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return original(group, sample, up, now, stops)

    engine.outputs._apply = apply
    prompts = dict(enumerate(PROMPTS))
    prompts["bad"] = BAD
    done = run(engine, prompts)
    bad = done.pop("bad")
    assert "injected detokenizer fault" in bad.error and bad.outputs[0].finish_reason == "error"
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == reference
    assert_nothing_held(engine)


def test_a_stop_string_finish_leaves_no_group_behind(llama_dir):
    """Defect 7: a sample ended by a stop string (found in the front end) left its entry in
    EngineCore._groups: one leaked entry per request, and its id could never be used again."""
    engine = make_engine(llama_dir)
    greedy = run(engine, {"probe": PROMPTS[0]})["probe"].outputs[0].text
    stop = greedy[3:6]
    assert stop, greedy
    params = SamplingParams(temperature=0.0, max_tokens=10, stop=[stop], ignore_eos=True)
    for _ in range(2):  # the same id again, after it finished
        out = run(engine, {"same-id": PROMPTS[0]}, params)["same-id"]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert_nothing_held(engine)


SPEC = {
    "none": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    },
    "draft": {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False},
}


@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("seed", [0, 1])
def test_churn_leaves_nothing_behind(llama_dir, spec, seed):
    config = SPEC[spec]
    if config is not None and config["method"] == "draft_model":
        config = {**config, "model": str(llama_dir)}
    # A cache this small preempts: 24 blocks of 4 tokens for up to 4 sequences of up to 64 tokens.
    engine = make_engine(llama_dir, num_kv_blocks=24, max_num_seqs=4, speculative_config=config)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    live: set[str] = set()
    finished: dict[str, int] = {}
    next_id = 0
    for _ in range(160):
        if rng.random() < 0.35 and len(live) < 10:
            rid = f"r{next_id % 7}" if rng.random() < 0.3 and f"r{next_id % 7}" not in live else f"q{next_id}"
            next_id += 1
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
            if rng.random() < 0.3:
                prompt = (prompt[:4] * 10)[: rng.randrange(4, 40)]  # repeats: n-gram drafts hit
            params = SamplingParams(
                n=rng.choice([1, 1, 2, 3]),
                temperature=rng.choice([0.0, 0.0, 0.7, 1.3]),
                top_k=rng.choice([0, 5]),
                seed=rng.choice([None, rng.randrange(100)]),
                max_tokens=rng.randrange(1, 24),
                stop=rng.choice([[], ["e"], ["(", "\n"], ["self"]]),
                logprobs=rng.choice([None, None, 2]),
                presence_penalty=rng.choice([0.0, 0.5]),
                ignore_eos=rng.random() < 0.5,
            )
            engine.add_request(rid, prompt, params)
            live.add(rid)
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert out.request_id in live, out.request_id
                    live.discard(out.request_id)
                    finished[out.request_id] = finished.get(out.request_id, 0) + 1
                    for c in out.outputs:
                        assert c.finish_reason in ("stop", "length"), c
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    assert not live
    assert len(finished) >= 20, "the churn finished too little to mean anything"
    stats = engine.core.snapshot()
    assert stats["num_preemptions"] > 0
    if config is not None:
        assert stats["spec_decode_num_drafts"] > 20
    assert_nothing_held(engine)
