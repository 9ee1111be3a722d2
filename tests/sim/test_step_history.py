"""What ran before a step (tandem/sim/step_history.py): the classes, their fit on served steps, and
the simulator charging them."""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path

import pytest

from tandem.core.request import Request
from tandem.core.step_shape import StepShape
from tandem.engine.step_trace import BUSY_GAP_S, StepTrace
from tandem.sampling_params import SamplingParams
from tandem.sim.calibrate import calibrate
from tandem.sim.cost import FittedCost, load_cost, save_cost
from tandem.sim.instance import InstanceSpec, SimInstance
from tandem.sim.step_history import (
    AFTER_LARGE_PROMPT,
    AFTER_SMALL_PROMPT,
    DECODE,
    IDLE,
    LARGE_PROMPT,
    SECOND_AFTER_PROMPT,
    SMALL_PROMPT,
    STEADY,
    StepHistory,
    histories,
    kind,
)


def decode(rows: int) -> StepShape:
    return StepShape(0, rows, 100 * rows, rows)


def prompt(tokens: int, rows: int = 0) -> StepShape:
    return StepShape(tokens, rows, tokens + 100 * rows, rows + 1)


def test_kinds_and_histories_of_one_engine():
    assert (kind(decode(4)), kind(prompt(100)), kind(prompt(300))) == (DECODE, SMALL_PROMPT, LARGE_PROMPT)
    history = StepHistory()
    steps = [prompt(300), decode(1), decode(1), decode(1), prompt(50, 1), decode(2), prompt(400, 2), prompt(300, 2)]
    seen = []
    t = 0.0
    for shape in steps:
        seen.append(history.before(t))
        t += 0.01
        history.after(shape, t)
        t += 0.001
    assert seen == [
        IDLE, AFTER_LARGE_PROMPT, SECOND_AFTER_PROMPT, STEADY, STEADY, AFTER_SMALL_PROMPT, SECOND_AFTER_PROMPT,
        AFTER_LARGE_PROMPT,
    ]
    assert history.before(t + BUSY_GAP_S) == IDLE  # the engine sat idle in between
    assert history.before(t) == AFTER_LARGE_PROMPT


def test_histories_of_a_shared_trace_follow_each_engine():
    """Two engines append to one trace file: each line's history is its own engine's."""
    a = [(0.000, prompt(300)), (0.021, decode(1)), (0.024, decode(1))]
    b = [(0.010, decode(2)), (0.013, prompt(100, 2)), (0.030, decode(3))]
    lines = [
        {"pid": pid, "start": start, "seconds": 0.002 if shape.prefill_tokens == 0 else 0.015, **asdict(shape)}
        for pid, steps in ((1, a), (2, b))
        for start, shape in steps
    ]
    lines.sort(key=lambda line: line["start"])
    got = {(line["pid"], line["start"]): h for line, h in zip(lines, histories(lines))}
    assert [got[(1, s)] for s, _ in a] == [IDLE, AFTER_LARGE_PROMPT, SECOND_AFTER_PROMPT]
    assert [got[(2, s)] for s, _ in b] == [IDLE, STEADY, AFTER_SMALL_PROMPT]


def test_calibrate_fits_what_the_step_before_costs(tmp_path: Path):
    """Served steps whose cost depends on the step before (the first two decode steps after a large
    prompt chunk 1.3x and 1.15x, a large chunk right after another 0.85x): the fitted classes
    recover the factors, the cell corrections stay near 1, and a model with them predicts the
    steps of another trace of the same kind within 2%."""

    def traced(path: Path, seed: int) -> list[tuple[StepShape, float, int]]:
        rng = random.Random(seed)
        trace = StepTrace(path)
        history = StepHistory()
        start = 0.0
        out = []
        for _ in range(3000):
            if rng.random() < 0.15:
                shape = prompt(rng.randrange(300, 500), rng.randrange(0, 8))
            else:
                shape = decode(rng.randrange(1, 12))
            base = 0.002 + 5e-5 * shape.tokens + 1e-4 * shape.decode_rows
            h = history.before(start)
            if shape.prefill_tokens == 0:
                factor = {AFTER_LARGE_PROMPT: 1.3, SECOND_AFTER_PROMPT: 1.15}.get(h, 1.0)
            else:
                factor = 0.85 if h == AFTER_LARGE_PROMPT else 1.0
            seconds = base * factor
            trace.record(start, seconds, shape, 0)
            out.append((shape, seconds, h))
            history.after(shape, start + seconds)
            start += seconds + 3e-4
        trace.close()
        return out

    traced(tmp_path / "a.jsonl", 0)
    fitted = calibrate([tmp_path / "a.jsonl"], FittedCost("base", {"const": 0.1}))
    steady = fitted.transitions.get((DECODE, STEADY), 1.0)
    assert fitted.transitions[(DECODE, AFTER_LARGE_PROMPT)] / steady == pytest.approx(1.3, rel=0.03)
    assert fitted.transitions[(DECODE, SECOND_AFTER_PROMPT)] / steady == pytest.approx(1.15, rel=0.03)
    assert fitted.transitions[(LARGE_PROMPT, AFTER_LARGE_PROMPT)] < 0.9
    other = traced(tmp_path / "b.jsonl", 1)
    for h in (AFTER_LARGE_PROMPT, SECOND_AFTER_PROMPT, STEADY):
        real = sum(t for s, t, hh in other if hh == h and s.prefill_tokens == 0)
        model = sum(fitted.step_seconds(s, hh) for s, _, hh in other if hh == h and s.prefill_tokens == 0)
        assert model == pytest.approx(real, rel=0.02)
    save_cost(fitted, tmp_path / "fitted.json")
    again = load_cost(tmp_path / "fitted.json")
    assert again.step_seconds(decode(4), AFTER_LARGE_PROMPT) == fitted.step_seconds(decode(4), AFTER_LARGE_PROMPT)
    # Without a history (a caller that does not track one) the class factors are not applied.
    cells_only = FittedCost("x", fitted.coefficients, corrections=fitted.corrections)
    assert fitted.step_seconds(decode(4)) == cells_only.step_seconds(decode(4))


def test_the_simulated_instance_charges_the_step_before():
    """A decode step straight after a large prompt chunk costs its class's factor; the next ones
    do not."""
    cost = FittedCost("lin", {"const": 0.002, "tokens": 1e-4}, transitions={(DECODE, AFTER_LARGE_PROMPT): 2.0})
    clock = [0.0]
    inst = SimInstance(0, InstanceSpec(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=512), cost, clock)
    inst.add(Request("r", list(range(300)), SamplingParams(max_tokens=4, ignore_eos=True), max_tokens=4))
    durations = []
    for _ in range(3):
        seconds = inst.start_step()
        assert seconds is not None
        durations.append(seconds)
        clock[0] += seconds
        inst.finish_step()
        clock[0] += 1e-4
    assert durations[0] == pytest.approx(0.002 + 300 * 1e-4)  # the prompt, after idleness
    assert durations[1] == pytest.approx(2 * (0.002 + 1e-4))  # the first decode after it
    assert durations[2] == pytest.approx(0.002 + 1e-4)
