"""Instances that share one machine: CPU instances co-located on a host share its cores, caches
and memory bandwidth, so each runs its steps slower while others run theirs.

While `k` of a host's instances are in a step, each step advances at 1 / `slowdown(k)` of its own
speed (the cost model's `co_run_slowdown`). A step is an amount of work (its seconds alone); when
an instance starts or ends a step, the others' remaining work is brought up to date and their end
times change. Instances on hosts of their own (GPUs, the default) never come here.
"""

from __future__ import annotations

from collections.abc import Callable


class Host:
    def __init__(self, slowdown: Callable[[int], float]) -> None:
        self.slowdown = slowdown
        # instance -> [work left in seconds alone, the time it was last brought up to date]
        self._running: dict[int, list[float]] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _rate(self) -> float:
        return 1.0 / self.slowdown(len(self._running)) if self._running else 1.0

    def _advance(self, now: float) -> None:
        rate = self._rate()
        for state in self._running.values():
            state[0] = max(0.0, state[0] - (now - state[1]) * rate)
            state[1] = now

    def start(self, instance: int, work_s: float, now: float) -> dict[int, float]:
        """`instance` starts a step of `work_s`; every running step's (new) end time."""
        self._advance(now)
        self._running[instance] = [work_s, now]
        return self._ends(now)

    def finish(self, instance: int, now: float) -> dict[int, float]:
        """`instance`'s step is over; the remaining steps' (new) end times."""
        self._advance(now)
        del self._running[instance]
        return self._ends(now)

    def _ends(self, now: float) -> dict[int, float]:
        rate = self._rate()
        return {i: now + state[0] / rate for i, state in self._running.items()}
