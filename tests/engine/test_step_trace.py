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
    assert len(lines) == llm.engine.counters.engine_steps
    assert all(line["pid"] == lines[0]["pid"] and line["seconds"] > 0 for line in lines)
    starts = [line["start"] for line in lines]
    assert starts == sorted(starts)
    # Every prompt token is computed once in a prefill chunk; the first sampled token comes from the
    # prompt's last chunk, every later one from a decode row (a 40-token prompt is two chunks under
    # the 32-token budget, which also caps each step).
    assert sum(line["prefill_tokens"] for line in lines) == 40 + 7 + 19
    assert (
        sum(line["decode_rows"] for line in lines) == sum(len(o.outputs[0].token_ids) - 1 for o in outs) == 15
    )
    assert max(line["prefill_tokens"] + line["decode_rows"] for line in lines) <= 32
    assert lines[0]["waiting"] >= 1  # the budget left requests waiting after the first plan
    # Each request is listed once, at the step that first scheduled it, with an arrival before it.
    arrivals = [(a, line["start"]) for line in lines for a in line.get("arrivals", [])]
    assert len(arrivals) == 3
    assert all(a <= start for a, start in arrivals)
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
        line(1, 0.000, 0.010),
        line(2, 0.001, 0.020),
        line(1, 0.011, 0.010),  # gap 1 ms (pid 1)
        line(2, 0.023, 0.020),  # gap 2 ms (pid 2)
        line(1, 0.021 + 2 * BUSY_GAP_S, 0.010),  # idle, not a gap
    ]
    assert sorted(loop_gaps(lines)) == [pytest.approx(0.001), pytest.approx(0.002)]
    assert loop_gaps([]) == []


def test_idle_arrival_waits_keep_requests_that_found_their_engine_idle():
    """The way into the engine: a request that arrived while its engine was between steps counts
    (arrival to the start of the step that scheduled it); one that arrived during a step also
    waited for the step's rest, and is left out. Engines are taken apart."""
    from tandem.engine.step_trace import idle_arrival_waits

    lines = [
        {"pid": 1, "start": 1.000, "seconds": 0.100, "arrivals": [0.999]},  # idle before: 1 ms
        {"pid": 1, "start": 1.101, "seconds": 0.010, "arrivals": [1.050]},  # arrived mid-step
        {"pid": 2, "start": 1.050, "seconds": 0.010, "arrivals": [1.048, 1.047]},  # other engine, idle
        {"pid": 1, "start": 2.000, "seconds": 0.010, "arrivals": [1.997]},  # idle again: 3 ms
        {"pid": 1, "start": 2.010, "seconds": 0.010},
    ]
    assert sorted(idle_arrival_waits(lines)) == [
        pytest.approx(0.001),
        pytest.approx(0.002),
        pytest.approx(0.003),
        pytest.approx(0.003),
    ]
    assert idle_arrival_waits([]) == []
