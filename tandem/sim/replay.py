"""Replay: the simulator driven by the step durations a real run recorded (its step trace,
tandem/engine/step_trace.py), to check that it runs the same scheduling as the engines did.

Each instance's k-th working step in the simulation lasts as long as that engine's k-th recorded
step; everything else (transfers, the front end's times) comes from a base cost model. If the
simulator schedules as the engines did, its k-th step has the recorded step's shape, and each
request's tokens come out when the real run's did: its TTFT and inter-token latencies match the
run's, whatever the machine's speed. A step whose shape differs from the recorded one is counted
(`ReplayedSteps.diverged`, with the first such step kept): from there on the two runs no longer
do the same work, and what follows says little. Past the recorded steps, the base model times
them (`ReplayedSteps.extra`).

With the loop's own times (`replay_steps(..., gaps=True)`), each step also ends in the gap the
engine left between it and its next recorded step (the loop's work, or the engine's idle time), so
a step starts when the recorded one did if the one before ended when its recorded one did; with
`RecordedTimes` the simulator also takes each request to its engine after its recorded way in
(tandem/sim/replay_run.py replays a served run that way).

A step trace names each engine by its process id; `replay_costs` takes the engines in the order
given, or (no order given) in the order of their first step: the first request of a run goes to
instance 0, the next to instance 1 and so on under round_robin and least_load, so the engine that
started first is instance 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.core.step_shape import StepShape
from tandem.engine.step_trace import line_shape, per_engine, read_step_trace
from tandem.sim.cost import CostModel, FrontEndCpu


@dataclass
class ReplayedSteps:
    """One engine's recorded steps, served in order."""

    durations: list[float]
    shapes: list[StepShape]
    served: int = 0
    diverged: int = 0
    first_divergence: tuple[int, StepShape, StepShape] | None = field(
        default=None
    )  # (step, recorded, simulated)
    extra: int = 0
    # Seconds from each step's end to the next recorded step's start (None: the base model's loop gap).
    gaps: list[float] | None = None
    gap_due: bool = False  # a served step's gap not yet taken


@dataclass(frozen=True)
class MoveAct:
    """One act of a recorded move on one engine (tandem/engine/step_trace.py's move lines)."""

    instance: int
    kind: str  # "begin", "stage", "pause", "end" (the source); "accept", "install" (the destination)
    step: int  # the engine's steps recorded before it: it came after the step-th, before the next
    at_s: float  # on the simulator's clock
    blocks: int | None = None  # what it moved, reserved or installed
    outcome: str | None = None  # "end": how the transfer ended


@dataclass(frozen=True)
class RecordedMove:
    """A move as the run made it: which request, when the front end decided it and saw its outcome,
    and its engines' acts in the order they happened."""

    index: int  # the trace request (the simulator's order)
    source: int
    destination: int
    decided_s: float
    acts: tuple[MoveAct, ...]
    landed_s: float | None = None  # the source's outcome reached the front end (None: never)
    outcome: str | None = None  # that outcome (MoveOutcome's value)


@dataclass(frozen=True)
class RecordedTimes:
    """What a replay takes from the run instead of the cost model, on the simulator's clock."""

    ingress_s: list[float]  # per trace request: from the front end placing it to its engine taking it in
    first_step_s: list[float]  # per instance: when its first recorded step began
    # Per trace request: when the front end released it from the dispatcher's count (None: at the
    # end of its last step, as the simulator does by itself).
    release_s: list[float | None] | None = None
    # The run's moves, replayed as recorded instead of the migration policy's rounds (None: the
    # simulator runs its own rounds). Each act happens at its recorded moment; what a stage or
    # pause moves is the simulator's own protocol's choice, set against the record.
    moves: list[RecordedMove] | None = None


class ReplayCost:
    """A cost model for one simulated instance: its working steps take the recorded durations."""

    def __init__(self, base: CostModel, steps: ReplayedSteps) -> None:
        self.base = base
        self.steps = steps

    @property
    def name(self) -> str:
        return f"replay over {self.base.name}"

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        if shape.prefill_tokens == 0 and shape.decode_rows == 0:
            return 0.0  # nothing planned: the engine records no step and spends no time on it
        s = self.steps
        k = s.served
        if k >= len(s.durations):
            s.extra += 1
            return self.base.step_seconds(shape, history)
        s.served += 1
        s.gap_due = True
        if shape != s.shapes[k]:
            s.diverged += 1
            if s.first_divergence is None:
                s.first_divergence = (k, s.shapes[k], shape)
        return s.durations[k]

    def transfer_seconds(self, num_blocks: int) -> float:
        return self.base.transfer_seconds(num_blocks)

    def delivery_seconds(self) -> float:
        return self.base.delivery_seconds()

    def ingress_seconds(self) -> float:
        return self.base.ingress_seconds()

    def loop_gap_seconds(self) -> float:
        s = self.steps
        if s.gaps is None or s.extra:
            return self.base.loop_gap_seconds()
        if not s.gap_due:
            return 0.0  # an empty plan (nothing recorded): the loop goes straight on
        s.gap_due = False
        return s.gaps[s.served - 1]

    def co_run_slowdown(self, running: int) -> float:
        return 1.0  # the recorded durations already ran beside the other engines

    def front_end_cpu(self) -> FrontEndCpu:
        return self.base.front_end_cpu()


def engine_order(lines: list[dict[str, Any]]) -> list[int]:
    """The engines' process ids in the order of their first step."""
    firsts: dict[int, float] = {}
    for line in lines:
        firsts[line["pid"]] = min(line["start"], firsts.get(line["pid"], line["start"]))
    return sorted(firsts, key=lambda pid: firsts[pid])


def step_gaps(own: list[dict[str, Any]]) -> list[float]:
    """Seconds from each of one engine's steps' end to its next step's start (0 after the last)."""
    gaps = [max(0.0, b["start"] - a["start"] - a["seconds"]) for a, b in itertools.pairwise(own)]
    return [*gaps, 0.0] if own else []


def replay_steps(
    lines: list[dict[str, Any]], pids: Sequence[int] | None = None, gaps: bool = False
) -> list[ReplayedSteps]:
    """Each engine's steps from a step trace's lines: the engines `pids` in that order, or every
    engine in the trace in the order of its first step; `gaps`: with the loop's recorded gaps."""
    by_pid = {own[0]["pid"]: own for own in per_engine(lines) if own}
    order = list(pids) if pids is not None else engine_order(lines)
    return [
        ReplayedSteps(
            [line["seconds"] for line in by_pid.get(pid, [])],
            [line_shape(line) for line in by_pid.get(pid, [])],
            gaps=step_gaps(by_pid.get(pid, [])) if gaps else None,
        )
        for pid in order
    ]


def replay_costs(
    base: CostModel, trace_path: str, num_instances: int, pids: Sequence[int] | None = None
) -> list[ReplayCost]:
    """One `ReplayCost` per instance from a step-trace file (an instance the trace lacks replays
    nothing: the base model times its steps)."""
    steps = replay_steps(read_step_trace(trace_path), pids)
    steps += [ReplayedSteps([], []) for _ in range(num_instances - len(steps))]
    return [ReplayCost(base, s) for s in steps[:num_instances]]
