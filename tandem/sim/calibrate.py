"""A step-time model fitted on a serving engine's own steps (`--step-trace`) instead of the
profiler's grid (`tandem bench profile`).

The profiler times steps of an engine alone on the machine, shape after shape; a serving engine's
steps come in the mixes real traffic makes, beside the processes serving it (the API process, the
clients), and can cost more than the grid's steps of the same shapes (docs/simulator.md has the
comparison). Fitting the same features on the served steps keeps what a serving engine pays, and any
recorded deployment can calibrate the simulator. Transfers and the front end's delivery share are
taken from a base model (a profile), since a step trace does not time them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import date
from typing import Any

from tandem.core.step_shape import StepShape
from tandem.sim.cost import FitError, FittedCost, fit_cost

# Steps kept for the fit (an even sample of longer traces): forward feature selection refits the
# model per fold and candidate, and a few thousand steps already pin every coefficient.
MAX_FIT_STEPS = 2000
HELD_OUT_FRACTION = 0.25


def steps_of(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of every step in the trace files."""
    from tandem.engine.step_trace import line_shape, read_step_trace

    return [(line_shape(line), float(line["seconds"])) for path in paths for line in read_step_trace(path)]


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
    """Fit `base`'s kind of model on the traced steps; transfers and delivery come from `base`."""
    points = steps_of(paths)
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
        meta=meta,
    )
    error = FitError.of([model.step_seconds(s) for s, _ in test], [t for _, t in test], len(train))
    return replace(model, fit_error=error)
