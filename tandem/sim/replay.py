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

A step trace names each engine by its process id; `replay_costs` takes the engines in the order
given, or (no order given) in the order of their first step: the first request of a run goes to
instance 0, the next to instance 1 and so on under round_robin and least_load, so the engine that
started first is instance 0.
"""

from __future__ import annotations

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
        return self.base.loop_gap_seconds()

    def co_run_slowdown(self, running: int) -> float:
        return 1.0  # the recorded durations already ran beside the other engines

    def front_end_cpu(self) -> FrontEndCpu:
        return self.base.front_end_cpu()


def replay_steps(lines: list[dict[str, Any]], pids: Sequence[int] | None = None) -> list[ReplayedSteps]:
    """Each engine's steps from a step trace's lines: the engines `pids` in that order, or every
    engine in the trace in the order of its first step."""
    engines = per_engine(lines)
    by_pid = {own[0]["pid"]: own for own in engines if own}
    order = (
        list(pids)
        if pids is not None
        else [pid for pid, _ in sorted(by_pid.items(), key=lambda kv: kv[1][0]["start"])]
    )
    return [
        ReplayedSteps(
            [line["seconds"] for line in by_pid.get(pid, [])],
            [line_shape(line) for line in by_pid.get(pid, [])],
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
