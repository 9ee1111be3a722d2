"""An engine's per-step trace: one JSON line per step with when it started, how long it took and
the shape the scheduler planned (`tandem.core.step_shape.StepShape`), for setting a serving
engine's steps against a step-time model and the simulator's steps (benchmarks/sim_validation.py).

Enabled by `EngineConfig.step_trace` (`--step-trace FILE`). Several engine processes may append to
one file: each line names its process. Lines are written as steps end (line-buffered), so a trace
is complete up to the last step even if the engine is killed.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.core.step_shape import StepShape


class StepTrace:
    def __init__(self, path: str | os.PathLike[str], pid: int | None = None) -> None:
        """`pid`: what the lines name as their process (default: this one's id)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        self._pid = os.getpid() if pid is None else pid

    def record(
        self, start: float, seconds: float, shape: StepShape, waiting: int, arrivals: list[float] | None = None
    ) -> None:
        """`start`: time.monotonic() as the step began (comparable across processes on a host);
        `arrivals`: when the requests this step schedules for the first time arrived (the API
        process's time.monotonic())."""
        line: dict[str, Any] = {
            "pid": self._pid, "start": round(start, 6), "seconds": round(seconds, 6), "waiting": waiting, **asdict(shape)
        }
        if arrivals:
            line["arrivals"] = [round(a, 6) for a in arrivals]
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a trace file, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def line_shape(line: dict[str, Any]) -> StepShape:
    """The planned shape a trace line recorded (fields a line lacks take StepShape's defaults)."""
    return StepShape(**{k: line[k] for k in StepShape.__slots__ if k in line})


# Time between two consecutive steps of one engine shorter than this is the busy loop's own work;
# longer, the engine was idle.
BUSY_GAP_S = 0.05


def per_engine(lines: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each engine process's lines (several engines may share a file), in the order they started."""
    return [
        sorted((line for line in lines if line["pid"] == pid), key=lambda line: line["start"])
        for pid in {line["pid"] for line in lines}
    ]


def loop_gaps(lines: list[dict[str, Any]]) -> list[float]:
    """Seconds between each step's end and the same engine's next step's start, where the engine
    stayed busy (under BUSY_GAP_S): the loop's work outside the timed steps."""
    gaps: list[float] = []
    for own in per_engine(lines):
        gaps += [g for a, b in itertools.pairwise(own) if (g := b["start"] - a["start"] - a["seconds"]) < BUSY_GAP_S]
    return gaps


def idle_arrival_waits(lines: list[dict[str, Any]]) -> list[float]:
    """For each request that arrived while its engine was idle (its previous step had ended), the
    seconds from its arrival to the start of the step that first scheduled it: the way into the
    engine, with no step to wait for. Requests that arrived during a step are left out."""
    waits: list[float] = []
    for own in per_engine(lines):
        idle_since = float("-inf")
        for line in own:
            waits += [line["start"] - a for a in line.get("arrivals", ()) if a >= idle_since]
            idle_since = line["start"] + line["seconds"]
    return waits
