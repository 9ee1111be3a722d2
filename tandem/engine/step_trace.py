"""An engine's per-step trace: one JSON line per step with when it started, how long it took and
the shape the scheduler planned (`tandem.core.step_shape.StepShape`), for setting a serving
engine's steps against a step-time model and the simulator's steps (benchmarks/sim_validation.py).

Enabled by `EngineConfig.step_trace` (`--step-trace FILE`). Several engine processes may append to
one file: each line names its process. Lines are written as steps end (line-buffered), so a trace
is complete up to the last step even if the engine is killed.

A line also carries what a replay of the run needs (tandem/sim/replay_run.py), only where it
happened: `added`, the requests this engine took in since its previous step, each as [request id,
when the engine took it in, when the API process did]; `first`, the requests whose first token
this step made; `done`, each request that finished in this step as [request id, its output
tokens]. A token leaves the engine at its step's end (`start + seconds`). The API process adds
its own lines to the same file (`engine/front_trace.py`): when it placed each request on an instance and
when it released it from the dispatcher's count (it saw the request end), the two moments the
dispatcher's view changes; `read_step_trace` leaves them out, `front_end_events` reads them.

A move adds lines of its own (`move_lines` reads them): the API process's when it decided a move
("decided": which request, from which instance to which) and when the source's outcome reached it
("landed"); each engine's when its KV plane acted (`StepTrace.move`: the source began the move,
took a stage, paused the request and ended the transfer; the destination accepted it and installed
it), each with `step`, how many steps this engine had recorded then: the plane acts between
steps, so `step` k places the act after the engine's k-th step and before its next.
"""

from __future__ import annotations

import itertools
import json
import math
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
        self._added: list[list[Any]] = []  # taken in since the last recorded step
        self._steps = 0  # step lines written

    def added(self, request_id: str, at: float, arrival: float) -> None:
        """The engine took a request in at `at` (time.monotonic()); the API process had at
        `arrival`. Rounded down, so it never ties with the start of the step that follows."""
        self._added.append([request_id, math.floor(at * 1e6) / 1e6, round(arrival, 6)])

    def record(
        self,
        start: float,
        seconds: float,
        shape: StepShape,
        waiting: int,
        arrivals: list[float] | None = None,
        first: list[str] | None = None,
        done: list[tuple[str, int]] | None = None,
    ) -> None:
        """`start`: time.monotonic() as the step began (comparable across processes on a host);
        `arrivals`: when the requests this step schedules for the first time arrived (the API
        process's time.monotonic()); `first`: the requests whose first token this step made;
        `done`: (request id, output tokens) of those it finished."""
        line: dict[str, Any] = {
            "pid": self._pid, "start": round(start, 6), "seconds": round(seconds, 6), "waiting": waiting, **asdict(shape)
        }
        if arrivals:
            line["arrivals"] = [round(a, 6) for a in arrivals]
        if self._added:
            line["added"], self._added = self._added, []
        if first:
            line["first"] = first
        if done:
            line["done"] = [[rid, n] for rid, n in done]
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._steps += 1

    def move(self, kind: str, request_id: str, at: float, **fields: Any) -> None:
        """The KV plane acted on a move of `request_id` at `at` (time.monotonic()): `kind` is one of
        "begin", "stage", "pause", "end" (the source) or "accept", "install" (the destination);
        `fields` what it moved (blocks, outcome, measured seconds)."""
        line = {"pid": self._pid, "move": kind, "request": request_id, "at": round(at, 7), "step": self._steps}
        self._file.write(json.dumps({**line, **fields}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def _lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_step_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The step lines of a trace file, in file order."""
    return [line for line in _lines(path) if "start" in line]


def front_end_events(path: str | os.PathLike[str]) -> dict[str, dict[str, float]]:
    """The API process's lines of a trace file: per kind ("placed", "released"), request id -> when."""
    events: dict[str, dict[str, float]] = {"placed": {}, "released": {}}
    for line in _lines(path):
        for kind, times in events.items():
            if kind in line:
                times[line[kind]] = line["at"]
    return events


def move_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a trace file about moves (the engines' and the API process's), in file order."""
    return [line for line in _lines(path) if "move" in line]


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
