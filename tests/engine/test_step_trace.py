"""The engine's per-step trace (`step_trace`): one line per step whose planned shapes add up to the
work the requests did."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.step_trace import read_step_trace


def test_step_trace_records_every_step_and_its_shape(model_factory, tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = LLM(str(model_factory("llama")), num_kv_blocks=64, max_num_batched_tokens=32, step_trace=str(path))
    # Disjoint prompts: no prefix-cache hits, so every prompt token is computed.
    prompts = [{"prompt_token_ids": list(range(s, s + n))} for s, n in ((5, 40), (100, 7), (200, 19))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    lines = read_step_trace(path)
    assert len(lines) == llm.engine.core.stats.num_steps
    assert all(line["pid"] == lines[0]["pid"] and line["seconds"] > 0 for line in lines)
    starts = [line["start"] for line in lines]
    assert starts == sorted(starts)
    # Every prompt token is computed once in a prefill chunk; the first sampled token comes from the
    # prompt's last chunk, every later one from a decode row (a 40-token prompt is two chunks under
    # the 32-token budget, which also caps each step).
    assert sum(line["prefill_tokens"] for line in lines) == 40 + 7 + 19
    assert sum(line["decode_rows"] for line in lines) == sum(len(o.outputs[0].token_ids) - 1 for o in outs) == 15
    assert max(line["prefill_tokens"] + line["decode_rows"] for line in lines) <= 32
    assert lines[0]["waiting"] >= 1  # the budget left requests waiting after the first plan
    # A second engine appends to the same file.
    LLM(str(model_factory("llama")), num_kv_blocks=64, step_trace=str(path)).generate(
        prompts[:1], params, use_tqdm=False
    )
    assert len(read_step_trace(path)) > len(lines)


def test_loop_gaps_are_each_engines_busy_gaps_only():
    """Gaps are taken per engine process (two engines' steps interleave in one file) and only
    where the engine stayed busy: a pause longer than BUSY_GAP_S is idleness, not loop work."""
    from tandem.engine.step_trace import BUSY_GAP_S, loop_gaps

    def line(pid: int, start: float, seconds: float) -> dict:
        return {"pid": pid, "start": start, "seconds": seconds}

    lines = [
        line(1, 0.000, 0.010), line(2, 0.001, 0.020), line(1, 0.011, 0.010),  # gap 1 ms (pid 1)
        line(2, 0.023, 0.020),  # gap 2 ms (pid 2)
        line(1, 0.021 + 2 * BUSY_GAP_S, 0.010),  # idle, not a gap
    ]
    assert sorted(loop_gaps(lines)) == [pytest.approx(0.001), pytest.approx(0.002)]
    assert loop_gaps([]) == []
