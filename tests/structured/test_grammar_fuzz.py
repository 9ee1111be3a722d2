"""A grammar fuzz: random and adversarial structured-output specs (deep rule chains, deep nesting,
wide alternations, recursive `$ref`s, huge enums, counted repetitions, garbage) through the path a
server request takes (the front end's check in a check process, then the engine's compile thread
and a few masked steps). The test process must survive every one (a native stack overflow would
kill it), each spec is either refused with a ValueError naming its field or runs, and memory stays
bounded."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.engine.tokenizer import Tokenizer
from tandem.sampling_params import MAX_STRUCTURED_SPEC_CHARS, StructuredOutputsParams
from tandem.structured.checker import GrammarChecker
from tandem.structured.config import MIB
from tandem.structured.manager import StructuredOutputManager

pytestmark = pytest.mark.slow

# Sizes from small to far past what crashed the API process (3,000 chained rules).
SIZES = st.sampled_from([1, 7, 100, 1_000, 3_000, 10_000, 30_000])
WORDS = st.text(alphabet="abcdefghij", min_size=1, max_size=8)


def _lark_chain(n: int) -> dict:
    return {"grammar": "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'}


def _gbnf_chain(n: int) -> dict:
    n = min(n, 3_000)  # longer GBNF chains only time out (quadratic conversion): one such is enough
    return {"grammar": "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'}


def _optional_chain(n: int) -> dict:
    return {"grammar": "start: r0\n" + "".join(f'r{i}: "x" r{i + 1}?\n' for i in range(n)) + f'r{n}: "a"\n'}


def _lark_parens(n: int) -> dict:
    return {"grammar": "start: " + "(" * n + '"a"' + ")" * n}


def _regex_nesting(n: int) -> dict:
    return {"regex": "(" * n + "a" + ")" * n}


def _repetition(n: int) -> dict:
    return {"regex": f"(ab|cd|ef){{{n}}}x"}


def _alternation(n: int) -> dict:
    rng = random.Random(n)
    return {"regex": "|".join("".join(rng.choices("abcdefgh", k=6)) for _ in range(n))}


def _ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "boolean"}
    return {"json": {"$ref": "#/$defs/d0", "$defs": defs}}


def _recursive_ref(n: int) -> dict:
    node = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}, "y": {"$ref": "#/$defs/m"}}}
    other = {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": n}
    return {"json": {"$ref": "#/$defs/n", "$defs": {"n": node, "m": other}}}


def _enum(n: int) -> dict:
    rng = random.Random(n)
    return {"json": {"enum": [f"{''.join(rng.choices('abcdefgh', k=6))}{i}" for i in range(min(n, 20_000))]}}


def _nested_arrays(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(min(n, 200)):  # past 128 levels it is refused before any compiler sees it
        schema = {"type": "array", "items": schema, "maxItems": 2}
    return {"json": schema}


ADVERSARIAL = [
    _lark_chain, _gbnf_chain, _optional_chain, _lark_parens, _regex_nesting, _repetition,
    _alternation, _ref_chain, _recursive_ref, _enum, _nested_arrays,
]

garbage = st.one_of(
    st.builds(lambda t: {"grammar": t}, st.text(min_size=1, max_size=200)),
    st.builds(lambda t: {"grammar": "start: " + t}, st.text(alphabet='ab|()*+?": \n', min_size=1, max_size=200)),
    st.builds(lambda t: {"regex": t}, st.text(alphabet="ab|()*+?{}[]^$\\.0123456789,", min_size=1, max_size=80)),
    st.builds(lambda t: {"json": t}, st.text(alphabet='{}[]":,ab0123 ', min_size=1, max_size=120)),
    st.builds(lambda ws: {"choice": ws}, st.lists(WORDS, min_size=1, max_size=50)),
)
specs = st.one_of(st.builds(lambda make, n: make(n), st.sampled_from(ADVERSARIAL), SIZES), garbage)


@pytest.fixture(scope="module")
def target(llama_dir):
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    eos = Tokenizer(str(llama_dir)).eos_token_id or 0
    checker = GrammarChecker(str(llama_dir), vocab, (eos,), timeout_s=2.0)
    manager = StructuredOutputManager(str(llama_dir), vocab, (eos,), cache_size=16, cache_bytes=64 * MIB)
    yield checker, manager, vocab
    checker.close()
    manager.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=specs, seed=st.integers(0, 2**16))
def test_no_spec_kills_the_process(target, fields, seed):
    checker, manager, vocab = target
    try:
        sp = StructuredOutputsParams(**fields)
    except ValueError as exc:  # malformed, too long or too deep: refused before any compiler
        assert "structured_outputs" in str(exc)
        event("refused by its parameters")
        return
    assert len(sp.spec()[1]) <= MAX_STRUCTURED_SPEC_CHARS
    try:
        checker.check(sp)
    except ValueError as exc:
        assert str(exc).startswith("structured_outputs."), exc
        event("refused: " + ("crash" if "too complex" in str(exc) else "invalid or past the limits"))
        return
    event("compiled and stepped")
    # Passed the check: the engine compiles it on its compile thread and steps through it.
    matcher = manager.grammar(sp).matcher()
    rng = random.Random(seed)
    bitmask = np.zeros((1, manager.words), dtype=np.int32)
    for _ in range(6):
        if matcher.is_terminated():
            break
        bitmask[:] = 0
        matcher.fill_bitmask(bitmask, 0)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab])
        if not len(allowed):
            break
        if not matcher.accept(int(rng.choice(allowed))):
            break


def test_memory_stays_bounded_after_the_fuzz(target):
    """Runs after the fuzz in this module: what it compiled is bounded by the cache's byte bound."""
    checker, manager, _ = target
    assert manager.cached_bytes <= 64 * MIB
    before = _rss()
    for n in (1_000, 3_000, 10_000, 20_000):  # a round of the big ones again: nothing accumulates
        sp = StructuredOutputsParams(**_enum(n + 1))
        checker.check(sp)
        manager.grammar(sp)
    assert _rss() - before < 256 * MIB
