"""The API process's share of a step trace (tandem/engine/step_trace.py): one line each time it
places a request on an instance and each time it releases one from the dispatcher's count (it saw
the request end), the two moments the dispatcher's view of the instances changes. A replay of the
run (tandem/sim/replay_run.py) places and releases its requests at the same moments. With moves,
a line when it decided one and one when the source's outcome reached it (`move`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class FrontEndTrace:
    """The API process's lines of a step trace: one per placement and per release of a request."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        self._pid = os.getpid()

    def event(self, kind: str, request_id: str, at: float) -> None:
        """`kind`: "placed" or "released"; `at`: time.monotonic() (7 digits: the two kinds of one
        process must not tie)."""
        line = {"pid": self._pid, kind: request_id, "at": round(at, 7)}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def move(self, kind: str, request_id: str, at: float, **fields: object) -> None:
        """`kind`: "decided" (with `source`, `destination`) or "landed" (with `outcome`), as the
        engines' move lines (tandem/engine/step_trace.py) but on the API process's side."""
        line = {"pid": self._pid, "move": kind, "request": request_id, "at": round(at, 7), **fields}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
