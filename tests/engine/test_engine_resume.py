"""A request resumed on another engine from the tokens it had produced goes on exactly as if it had
never moved (greedy): what multi-instance fault recovery and recompute migration rely on."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import EngineCoreRequest
from tandem.sampling_params import SamplingParams

PROMPT = [5, 9, 11, 13, 17, 19, 23]


def engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, num_threads=1, block_size=4))


def tokens_of(core, request_id: str, until: int | None = None) -> dict[int, list[int]]:
    """Run the core, collecting each sample's tokens (stop after `until` steps)."""
    out: dict[int, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests() and (until is None or steps < until):
        for so in core.step():
            if so.request_id == request_id:
                out.setdefault(so.index, []).extend(so.new_token_ids)
        steps += 1
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=1.5, min_tokens=15),
        SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    ],
)
def test_resumed_request_continues_exactly(llama_dir, params):
    a, b = engine(llama_dir), engine(llama_dir)
    req = EngineCoreRequest("r", PROMPT, params, params.max_tokens, 0.0)
    a.core.add_request(req)
    whole = tokens_of(a.core, "r")
    a.core.add_request(EngineCoreRequest("r2", PROMPT, params, params.max_tokens, 0.0))
    partial = tokens_of(a.core, "r2", until=6)
    assert all(0 < len(t) < params.max_tokens for t in partial.values())
    resumed = [partial.get(i) for i in range(params.n)]
    b.core.add_request(EngineCoreRequest("r2", PROMPT, params, params.max_tokens, 0.0, resumed_outputs=resumed))
    rest = tokens_of(b.core, "r2")
    for i in range(params.n):
        assert partial[i] + rest[i] == whole[i]
    assert b.core._groups == {}


def test_resumed_samples_that_finished_stay_finished(llama_dir):
    e = engine(llama_dir)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    e.core.add_request(EngineCoreRequest("r", PROMPT, params, 8, 0.0, resumed_outputs=[None, [40, 41]]))
    out = tokens_of(e.core, "r")
    assert set(out) == {1} and len(out[1]) == 6
    with pytest.raises(ValueError, match="resumed_outputs"):
        e.core.add_request(EngineCoreRequest("x", PROMPT, params, 8, 0.0, resumed_outputs=[[1]]))
