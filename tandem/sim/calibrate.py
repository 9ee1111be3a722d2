"""A step-time model fitted on a serving engine's own steps (`--step-trace`) instead of the
profiler's grid (`tandem bench profile`).

The profiler times steps of an engine alone on the machine, shape after shape; a serving engine's
steps come in the mixes real traffic makes, beside the processes serving it (the API process, the
clients), and can cost more than the grid's steps of the same shapes (docs/simulator.md has the
comparison). Fitting the same features on the served steps keeps what a serving engine pays, and any
recorded deployment can calibrate the simulator. The engine loop's gap between busy steps is read
from the same trace; transfers and the front end's ingress and delivery times are taken from a base
model (a profile), since a step trace does not time them.
"""

from __future__ import annotations

import bisect
import os
import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import date
from typing import Any

from tandem.core.step_shape import StepShape
from tandem.sim.cost import FRONT_END_FIELDS, FitError, FittedCost, fit_cost

# Steps kept for the fit (an even sample of longer traces): forward feature selection refits the
# model per fold and candidate, and a few thousand steps already pin every coefficient.
MAX_FIT_STEPS = 2000
HELD_OUT_FRACTION = 0.25


def read_traces(paths: Sequence[str | os.PathLike[str]]) -> list[list[dict[str, Any]]]:
    """The lines of each step trace file."""
    from tandem.engine.step_trace import read_step_trace

    return [read_step_trace(path) for path in paths]


def steps_of(traces: Sequence[Sequence[dict[str, Any]]]) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of every step in the traces."""
    from tandem.engine.step_trace import line_shape

    return [(line_shape(line), float(line["seconds"])) for lines in traces for line in lines]


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
    if len(points) > MAX_FIT_STEPS:
        stride = len(points) / MAX_FIT_STEPS
        points = [points[int(i * stride)] for i in range(MAX_FIT_STEPS)]
    random.Random(seed).shuffle(points)
    cut = int(len(points) * (1 - HELD_OUT_FRACTION))
    dropped = ("points", "transfers", "note", "measured_on", "grid", "noise_percent", "profile_seconds")
    meta: dict[str, Any] = {k: v for k, v in base.meta.items() if k not in dropped}
    meta.update(
        source="step trace",
        step_traces=[os.path.basename(str(p)) for p in paths],
        steps_fitted=cut,
        measured_on=date.today().isoformat(),
        base_model=base.name,
    )
    train, test = points[:cut], points[cut:]
    selected = fit_cost(name or f"{base.name}-served", train, [])
    # The fit minimises relative error, which leaves the total under the traced one; queueing
    # delays near capacity grow steeply with the total busy time, so scale the coefficients to
    # the traced steps' total.
    scale = sum(t for _, t in train) / sum(selected.step_seconds(s) for s, _ in train)
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
    error = FitError.of([model.step_seconds(s) for s, _ in test], [t for _, t in test], len(train))
    return replace(model, fit_error=error)


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
    work = sum(model.step_seconds(line_shape(line)) for line in lines)

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
