"""A step-time model fitted on a serving engine's own steps (`--step-trace`) instead of the
profiler's grid (`tandem bench profile`).

The profiler times steps of an engine alone on the machine, shape after shape; a serving engine's
steps come in the mixes real traffic makes, beside the processes serving it (the API process, the
clients), and can cost more than the grid's steps of the same shapes (docs/simulator.md has the
comparison). Fitting the same features on the served steps keeps what a serving engine pays, and any
recorded deployment can calibrate the simulator. Served steps also show where the linear model is
biased, for a kind of step (full prompt chunks, full decode batches) and for what ran just before
a step: each (prompt tokens, decode rows) cell and each (step kind, history) class gets a factor
(`fit_factors`). The engine loop's gap between busy steps is read from the same trace; transfers
and the front end's ingress and delivery times are taken from a base model (a profile), since a
step trace does not time them.
"""

from __future__ import annotations

import bisect
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import date
from typing import Any

from tandem.core.step_shape import StepShape
from tandem.sim.cost import FRONT_END_FIELDS, FitError, FittedCost, fit_cost, shape_cell
from tandem.sim.step_history import histories
from tandem.sim.step_history import kind as step_kind

# Steps the linear fit uses at most (a random sample of longer traces): forward feature selection
# refits the model per fold and candidate, and a few thousand steps already pin every coefficient.
MAX_FIT_STEPS = 2000
HELD_OUT_FRACTION = 0.25
# A shape cell's correction is shrunk toward 1 as if this many more of its steps had cost what the
# linear model says: a cell of a few steps moves little, one of hundreds takes its own mean.
CORRECTION_PRIOR_STEPS = 5
# Corrections closer to 1 than this are left out (within the timer's and the machine's noise).
MIN_CORRECTION = 0.01
# The shape-cell and step-history factors are fitted in turn, each on what the other leaves.
FACTOR_ROUNDS = 3


def read_traces(paths: Sequence[str | os.PathLike[str]]) -> list[list[dict[str, Any]]]:
    """The lines of each step trace file."""
    from tandem.engine.step_trace import read_step_trace

    return [read_step_trace(path) for path in paths]


def steps_of(traces: Sequence[Sequence[dict[str, Any]]]) -> list[tuple[StepShape, float, int]]:
    """(shape, seconds, history) of every step in the traces (`tandem.sim.step_history`)."""
    from tandem.engine.step_trace import line_shape

    return [
        (line_shape(line), float(line["seconds"]), history)
        for lines in traces
        for line, history in zip(lines, histories(lines))
    ]


def mean_loop_gap(traces: Sequence[Sequence[dict[str, Any]]], default: float) -> float:
    """The engine loop's mean gap between busy steps over the traces (each file on its own), or
    `default` where they have none."""
    from tandem.engine.step_trace import loop_gaps

    gaps = [g for lines in traces for g in loop_gaps(list(lines))]
    return sum(gaps) / len(gaps) if gaps else default


def load_base(path: str | os.PathLike[str] | None) -> FittedCost:
    """The cost model at `path` (default: the shipped one), which must be a fitted one."""
    from tandem.sim.cli import DEFAULT_COST
    from tandem.sim.cost import load_cost

    base = load_cost(path or DEFAULT_COST)
    if not isinstance(base, FittedCost):
        raise ValueError(f"the base must be a fitted cost model (tandem bench profile), got a {type(base).__name__}")
    return base


def calibrate(
    paths: Sequence[str | os.PathLike[str]], base: FittedCost, name: str | None = None, seed: int = 0
) -> FittedCost:
    """Fit `base`'s kind of model on the traced steps, and the loop gap between them; transfers,
    ingress and delivery come from `base`."""
    traces = read_traces(paths)
    points = steps_of(traces)
    if len(points) < 8:
        raise ValueError(f"a step trace of {len(points)} steps is too short to fit a cost model (8 at least)")
    random.Random(seed).shuffle(points)
    # Held out: a fraction of what the linear fit may use; the fit takes a sample of the rest, the
    # shape corrections all of it.
    held = int(min(len(points), MAX_FIT_STEPS) * HELD_OUT_FRACTION)
    test, rest = points[:held], points[held:]
    train = rest[: MAX_FIT_STEPS - held]
    dropped = ("points", "transfers", "note", "measured_on", "grid", "noise_percent", "profile_seconds")
    meta: dict[str, Any] = {k: v for k, v in base.meta.items() if k not in dropped}
    meta.update(
        source="step trace",
        step_traces=[os.path.basename(str(p)) for p in paths],
        steps_fitted=len(train),
        measured_on=date.today().isoformat(),
        base_model=base.name,
    )
    selected = fit_cost(name or f"{base.name}-served", [(s, t) for s, t, _ in train], [])
    # The fit minimises relative error, which leaves the total under the traced one; queueing
    # delays near capacity grow steeply with the total busy time, so scale the coefficients to
    # the traced steps' total.
    scale = sum(t for _, t, _ in train) / sum(selected.step_seconds(s) for s, _, _ in train)
    meta["total_scale"] = round(scale, 4)
    model = FittedCost(
        selected.name,
        {k: v * scale for k, v in selected.coefficients.items()},
        transfer_t0_s=base.transfer_t0_s,
        transfer_per_block_s=base.transfer_per_block_s,
        transfer_fit_error=base.transfer_fit_error,
        delivery_s=base.delivery_s,
        ingress_s=base.ingress_s,
        loop_gap_s=mean_loop_gap(traces, base.loop_gap_s),
        **{name: getattr(base, name) for name in FRONT_END_FIELDS},
        meta=meta,
    )
    corrections, transitions = fit_factors(model, rest)
    meta.update(corrected_cells=len(corrections), steps_for_corrections=len(rest))
    model = replace(model, corrections=corrections, transitions=transitions)
    error = FitError.of([model.step_seconds(s, h) for s, _, h in test], [t for _, t, _ in test], len(train))
    return replace(model, fit_error=error)


Factors = dict[tuple[int, int], float]


def fit_factors(model: FittedCost, points: Sequence[tuple[StepShape, float, int]]) -> tuple[Factors, Factors]:
    """Factors on `model`'s linear seconds for the traced steps: per shape cell (`shape_cell`) and
    per (step kind, history) class (`tandem.sim.step_history`), each table fitted on what the other
    leaves, FACTOR_ROUNDS times in turn."""
    cells: Factors = {}
    classes: Factors = {}
    for _ in range(FACTOR_ROUNDS):
        with_classes = replace(model, corrections={}, transitions=classes)
        cells = _factor_table(points, with_classes.step_seconds, lambda shape, _: shape_cell(shape))
        with_cells = replace(model, corrections=cells, transitions={})
        classes = _factor_table(points, with_cells.step_seconds, lambda shape, history: (step_kind(shape), history))
    return cells, classes


def _factor_table(
    points: Sequence[tuple[StepShape, float, int]],
    predict: Callable[[StepShape, int], float],
    key: Callable[[StepShape, int], tuple[int, int]],
) -> Factors:
    """Per key: the traced seconds over the predicted, shrunk toward 1 by CORRECTION_PRIOR_STEPS;
    keys within MIN_CORRECTION of 1 are left out."""
    sums: dict[tuple[int, int], list[float]] = {}
    for shape, seconds, history in points:
        acc = sums.setdefault(key(shape, history), [0.0, 0.0, 0.0])
        acc[0] += seconds
        acc[1] += predict(shape, history)
        acc[2] += 1
    out: Factors = {}
    for k, (real, predicted, n) in sums.items():
        if predicted <= 0:
            continue
        prior = CORRECTION_PRIOR_STEPS * predicted / n  # that many steps at the model's own mean
        factor = (real + prior) / (predicted + prior)
        if abs(factor - 1.0) >= MIN_CORRECTION:
            out[k] = round(factor, 4)
    return out


def co_run_penalty(lines: Sequence[dict[str, Any]], model: FittedCost) -> float:
    """The penalty p for which `model` (fitted on an engine alone) accounts for the steps of several
    engines sharing one host: while k engines are in a step, each advances at 1 / (1 + p (k - 1)) of
    its own speed, so a step's work (the model's seconds for its shape) is the sum over the parts of
    its span of their length at that rate. Solved for the traced steps' total work (bisection: the
    total falls as p grows). 0 if the trace has one engine or none of its steps overlap."""
    from tandem.engine.step_trace import line_shape

    spans = [(float(line["start"]), float(line["start"]) + float(line["seconds"]), line["pid"]) for line in lines]
    if len({pid for _, _, pid in spans}) < 2:
        return 0.0
    # Concurrency over time: +1 at each start, -1 at each end.
    edges = sorted([(a, 1) for a, _, _ in spans] + [(b, -1) for _, b, _ in spans])
    times, levels, k = [], [], 0
    for t, d in edges:
        k += d
        times.append(t)
        levels.append(k)
    work = sum(model.step_seconds(line_shape(line), h) for line, h in zip(lines, histories(lines)))

    def covered(p: float) -> float:
        """Sum over steps of their span weighted by the rate at each moment."""
        total = 0.0
        for a, b, _ in spans:
            i = bisect.bisect_right(times, a) - 1
            t = a
            while t < b:
                k_here = max(1, levels[i]) if i >= 0 else 1
                nxt = times[i + 1] if i + 1 < len(times) else b
                end = min(b, nxt)
                total += (end - t) / (1.0 + p * (k_here - 1))
                t = end
                i += 1
        return total

    if covered(0.0) <= work:
        return 0.0
    lo, hi = 0.0, 1.0
    while covered(hi) > work and hi < 64:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if covered(mid) > work else (lo, mid)
    return (lo + hi) / 2


def calibrate_co_run(paths: Sequence[str | os.PathLike[str]], model: FittedCost) -> FittedCost:
    """`model` (steps of one engine alone on its host) with the co-run penalty and the loop gap of a
    served trace of several engines on one host."""
    traces = read_traces(paths)
    lines = [line for trace in traces for line in trace]
    if len(lines) < 8:
        raise ValueError(f"a step trace of {len(lines)} steps is too short to fit a co-run penalty (8 at least)")
    meta = {**model.meta, "co_run_traces": [os.path.basename(str(p)) for p in paths]}
    return replace(
        model,
        co_run_penalty=co_run_penalty(lines, model),
        loop_gap_s=mean_loop_gap(traces, model.loop_gap_s),
        meta=meta,
    )
