"""Structured output on a tiny random-weight model: the grammar, not the model, makes every output
valid. Random JSON schemas (hypothesis), regexes, choices and grammars, greedy and sampled; the
same greedy output with speculation on and off; n > 1, preemption, chunked prefill, prefix caching
and a resumed request; malformed specs refused with the field named."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import EngineCoreRequest
from tandem.sampling_params import StructuredOutputsParams

# Room for any output the bounded schemas below allow.
MAX_TOKENS = 200
ENGINE = {"num_kv_blocks": 256, "num_threads": 1, "max_num_seqs": 8}
PROMPTS = ["Reply in JSON:", "name age city {"]

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)


def scalar_schemas() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 1000),
        ),
        st.just({"type": "boolean"}),
        st.builds(
            lambda vals: {"enum": vals},
            st.lists(
                st.one_of(names, st.integers(-5, 5), st.booleans()), min_size=1, max_size=4, unique=True
            ),
        ),
    )


def object_schemas(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], data: st.DataObject) -> dict[str, Any]:
        required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return st.builds(build, st.dictionaries(names, inner, max_size=3), st.data())


def array_of(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda items, hi: {"type": "array", "items": items, "maxItems": hi}, inner, st.integers(0, 3)
    )


# Objects of scalars, arrays and objects, two levels deep.
level1 = st.one_of(scalar_schemas(), array_of(scalar_schemas()))
schemas = object_schemas(
    st.one_of(level1, object_schemas(level1), array_of(object_schemas(scalar_schemas())))
)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), **ENGINE)


def generate(llm: LLM, sp: StructuredOutputsParams, **kw: Any) -> list[Any]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=sp, **kw),
        SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, structured_outputs=sp, **kw),
    ]
    outs = llm.generate(PROMPTS, [params[0], params[1]], use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def check_json(schema: dict[str, Any], outputs: list[Any]) -> None:
    for c in outputs:
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas)
def test_random_json_schemas_validate(llm, schema):
    check_json(schema, generate(llm, StructuredOutputsParams(json=schema)))


def test_json_text_and_json_object(llm):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    check_json(schema, generate(llm, StructuredOutputsParams(json=json.dumps(schema))))
    outs = llm.generate(
        PROMPTS,
        SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
        use_tqdm=False,
    )
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text


# ASCII classes only: the engine's Unicode tables (\d, \w) are newer than this Python's `re`.
regex_atoms = st.sampled_from([r"[a-z]", r"[0-9]", r"[A-F0-9]", r"(ab|cd)", r"x", r"-", r"[.]"])
regexes = st.builds(
    lambda parts: "".join(f"{a}{{{lo},{lo + extra}}}" for a, lo, extra in parts),
    st.lists(st.tuples(regex_atoms, st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=4),
).filter(lambda r: re.fullmatch(r, "") is None)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=regexes)
def test_random_regexes_match(llm, pattern):
    for c in generate(llm, StructuredOutputsParams(regex=pattern)):
        assert c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), (pattern, c.text)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    choices=st.lists(
        st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=8),
        min_size=1,
        max_size=5,
        unique=True,
    )
)
def test_random_choices(llm, choices):
    for c in generate(llm, StructuredOutputsParams(choice=choices)):
        assert c.finish_reason == "stop"
        assert c.text in choices


def test_a_finished_choice_stops_before_min_tokens(llm):
    """min_tokens beyond what the grammar allows: the output completes the grammar and stops there
    (EOS is the only token it allows), rather than running on with tokens it forbids."""
    choices = ["yes", "no"]
    for c in generate(llm, StructuredOutputsParams(choice=choices), min_tokens=MAX_TOKENS - 1):
        assert c.finish_reason == "stop", c
        assert c.text in choices
        eos = llm.get_tokenizer().eos_token_id
        assert eos not in c.token_ids[:-1] and 0 not in c.token_ids, c.token_ids


@pytest.mark.parametrize(
    "grammar, pattern",
    [
        ('root ::= "a" ("b" | "c"){1,4} "."', r"a[bc]{1,4}\."),  # GBNF
        ('start: "x" DIGIT DIGIT\nDIGIT: /[0-9]/', r"x[0-9]{2}"),  # Lark
    ],
)
def test_grammars(llm, grammar, pattern):
    for c in generate(llm, StructuredOutputsParams(grammar=grammar)):
        assert c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), c.text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"json": {"type": "objekt"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"grammar": "root ::= ("}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
    ],
)
def test_bad_specs_are_value_errors(llm, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        sp = StructuredOutputsParams(**kwargs)
        llm.generate("hi", SamplingParams(structured_outputs=sp), use_tqdm=False)
    # The engine goes on.
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_exactly_one_field():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


SPEC_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "name"]}, "maxItems": 4},
        "n": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}
# Prompts that hold the JSON the grammar wants, so n-gram lookup proposes drafts (some of which
# the grammar refuses at a given point and must be rolled back over).
SPEC_PROMPTS = [
    '{"name":"name","tags":["a","b"],"n":12} {"name":"name","tags":["a","name"],"n":1} {"name":"',
    '"tags":["a","a","a","a"] "name":"aaaa" {"name":"',
    "nothing to look up here",
]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identical_with_and_without_speculation(llama_dir, model_factory, method):
    sp = StructuredOutputsParams(json=SPEC_SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=sp)
    if method == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        }
    else:
        draft = model_factory("llama", seed=3)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    plain = LLM(str(llama_dir), **ENGINE).generate(SPEC_PROMPTS, params, use_tqdm=False)
    spec_llm = LLM(str(llama_dir), speculative_config=spec, **ENGINE)
    fast = spec_llm.generate(SPEC_PROMPTS, params, use_tqdm=False)
    for a, b in zip(plain, fast):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        jsonschema.validate(json.loads(b.outputs[0].text), SPEC_SCHEMA)
    assert spec_llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    # Sampled output under speculation is valid too (rejection sampling over masked rows).
    sampled = spec_llm.generate(
        SPEC_PROMPTS,
        SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs=sp),
        use_tqdm=False,
    )
    check_json(SPEC_SCHEMA, [o.outputs[0] for o in sampled])
    assert spec_llm.engine.core.structured.num_tracked == 0  # every matcher dropped with its request


def test_n_preemption_chunked_prefill_prefix_cache(llama_dir):
    # Few KV blocks for ten concurrent samples: requests are preempted and resumed; a short token
    # budget splits prompts into chunks; the repeated prompt hits the prefix cache.
    llm = LLM(
        str(llama_dir),
        num_kv_blocks=48,
        block_size=4,
        max_num_seqs=10,
        max_num_batched_tokens=24,
        num_threads=1,
    )
    sp = StructuredOutputsParams(json=SPEC_SCHEMA)
    prompts = [
        f"prompt number {i}: a fairly long prompt that spans several chunks of the budget" for i in range(4)
    ]
    outs = llm.generate(
        [prompts[0], *prompts],
        SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=120, structured_outputs=sp),
        use_tqdm=False,
    )
    core = llm.engine.core
    assert core.counters.num_preemptions > 0
    assert core.counters.prefix_cache_hits > 0
    samples = [c for o in outs for c in o.outputs]
    assert len(samples) == 10
    check_json(SPEC_SCHEMA, samples)
    assert core.structured.num_tracked == 0


def test_resumed_request_replays_its_tokens(llama_dir):
    """A request resumed with tokens already produced (another instance ran part of it) rebuilds
    its matcher by replaying them and finishes the same JSON."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), **ENGINE))
    sp = StructuredOutputsParams(json=SPEC_SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=sp)
    tok = engine.tokenizer
    ids = tok.encode("resume me", add_special_tokens=False)
    head = tok.encode('{"name":"', add_special_tokens=False)
    req = EngineCoreRequest("r", ids, params, MAX_TOKENS, 0.0, resumed_outputs=[head])
    engine.core.add_request(req)
    tokens = list(head)
    while engine.core.has_unfinished_requests():
        for so in engine.core.step():
            tokens += so.new_token_ids
            finish = so.finish_reason
    assert finish == "stop"
    text = tok.decode(tokens)
    assert text.startswith('{"name":"')
    jsonschema.validate(json.loads(text), SPEC_SCHEMA)


def allowed(bitmask_row: Any, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_draft_rows_walk_the_grammar_and_roll_back(llama_dir):
    """Rows under speculation: each draft row is masked from the state after the drafts before it;
    rows after a draft the grammar refuses are unconstrained; the matcher ends where it started."""
    from tandem.core.request import Request
    from tandem.engine.tokenizer import Tokenizer
    from tandem.structured.manager import StructuredOutputManager

    tok = Tokenizer(str(llama_dir))
    vocab = 512
    manager = StructuredOutputManager(str(llama_dir), vocab, (2,), cache_size=4)
    sp = StructuredOutputsParams(regex="(ab|ac)d")
    req = Request("r", [5, 6], SamplingParams(structured_outputs=sp), max_tokens=8, eos_token_ids=(2,))
    a, b, d = (tok.encode(ch, add_special_tokens=False) for ch in "abd")
    assert len(a) == len(b) == len(d) == 1
    a, b, d = a[0], b[0], d[0]
    rows = [(req, []), (req, [a]), (req, [a, b]), (req, [a, b, d])]
    constrained, mask = manager.token_bitmask(rows)
    first = allowed(mask[0], vocab)
    assert constrained == [0, 1, 2, 3]
    decoded = [{tok.decode([t], skip_special_tokens=False) for t in allowed(m, vocab)} for m in mask]
    assert "a" in decoded[0] and "b" not in decoded[0]
    assert {"b", "c"} <= decoded[1] and "d" not in decoded[1]
    assert decoded[2] == {"d"}
    assert allowed(mask[3], vocab) == {2}  # complete: EOS only
    # A refused draft (d where b or c must come): its row is masked, later rows are not constrained.
    constrained, mask = manager.token_bitmask([(req, []), (req, [a]), (req, [a, d]), (req, [a, d, d])])
    assert constrained == [0, 1]
    # Rolled back: the matcher still allows "a" first, and accepts the whole output.
    constrained, mask = manager.token_bitmask([(req, [])])
    assert allowed(mask[0], vocab) == first
    m = manager.matcher(req)
    assert all(m.accept(t) for t in (a, b, d))
    m.fill_bitmask(mask, 0)
    assert allowed(mask[0], vocab) == {2}


def test_slow_compile_does_not_hold_up_other_requests(llama_dir):
    """A grammar compiling (here held back until released) keeps only its own request waiting; the
    engine steps the others meanwhile, then runs it; a compile that fails fails only its request."""
    import threading

    engine = LLMEngine(EngineConfig(model=str(llama_dir), **ENGINE))
    core = engine.core
    release = threading.Event()
    compile_real = core.structured._compile

    def held(key: Any) -> Any:
        release.wait(30)
        if key[0] == "regex" and key[1] == "z+":
            raise ValueError("structured_outputs.regex failed to compile (injected)")
        return compile_real(key)

    core.structured._compile = held  # type: ignore[method-assign]
    schema = {
        "type": "object",
        "properties": {"k": {"type": "boolean"}},
        "required": ["k"],
        "additionalProperties": False,
    }
    engine.add_request(
        "slow", "a", SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    )
    engine.add_request(
        "bad", "a", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="z+"))
    )
    engine.add_request("plain", "a", SamplingParams(max_tokens=6, ignore_eos=True))
    done: dict[str, Any] = {}
    while "plain" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "slow" not in done and "bad" not in done  # the plain request finished while they waited
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].outputs[0].finish_reason == "error"
    slow = done["slow"].outputs[0]
    assert slow.finish_reason == "stop"
    jsonschema.validate(json.loads(slow.text), schema)
