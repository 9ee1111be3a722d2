"""Runs the migration policy against a front end: every round, the rebalancer's moves are started
on it (live, or by recompute); `drain` empties an instance and retires it.

The front end is reached through `MoveFront`, a narrow view: the server's engine client
(tandem/engine/core_client.py) and the cluster simulator (tandem/sim/simulator.py) both implement
it, so both run these rounds."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol, runtime_checkable

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.cluster.rebalance import Rebalancer, RequestView
from tandem.engine.placement import Disaggregation
from tandem.kvtransfer.routes import MovableRequest

logger = logging.getLogger("tandem.cluster")


class MoveFront(Protocol):
    """What the migration policy needs of a front end."""

    @property
    def dead(self) -> str | None: ...

    @property
    def live(self) -> set[int]: ...

    @property
    def draining(self) -> set[int]: ...

    @property
    def disaggregation(self) -> Disaggregation | None: ...

    def movable(self) -> list[MovableRequest]:
        """The requests running on an instance with no move under way."""
        ...

    def incoming(self) -> dict[int, int]:
        """Seats the moves under way will take, per destination."""
        ...

    @property
    def moves(self) -> dict: ...

    def move(self, request_id: str, instance: int, live: bool) -> bool:
        """Start moving a request, live or by recompute; False if it cannot move now."""
        ...


@runtime_checkable
class DrainFront(MoveFront, Protocol):
    """A front end whose instances can be drained and shut down (the server's)."""

    def runs_on(self, instance: int) -> bool:
        """Whether a request runs on `instance` or a move goes from or to it."""
        ...

    async def retire(self, instance: int) -> None: ...


class Migrator:
    def __init__(self, config: ClusterConfig, front: MoveFront, dispatcher: Dispatcher) -> None:
        self.config = config
        self.front = front
        self.dispatcher = dispatcher
        self.rebalancer = Rebalancer(config)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tandem-migrator")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.migration_interval_s)
            try:
                self.round()
            except Exception:  # a policy bug must not stop serving
                logger.exception("migration round failed")

    def round(self) -> int:
        """Plan and start this round's moves; returns how many started."""
        front, dispatcher = self.front, self.dispatcher
        if front.dead is not None:
            return 0
        views = [
            RequestView(
                r.request_id,
                r.instance,
                r.priority,
                r.started,
                r.seq,
                dispatcher.demand_of(r.request_id),
                r.seats,
            )
            for r in front.movable()
        ]
        draining = front.draining
        live = set(front.live)
        pd = front.disaggregation
        if pd is not None:  # prefill instances hand their requests off on their own
            live &= set(pd.decode) | draining
            views = [v for v in views if v.instance in live]
        plan = self.rebalancer.plan(
            dispatcher.instances, live, draining, views, len(front.moves), front.incoming()
        )
        live_mode = self.config.migration_mode == "live"
        return sum(front.move(rid, dest, live_mode) for rid, dest in plan)

    async def drain(self, instance: int, timeout: float = 600.0) -> float:
        """Move every request off `instance`, then shut it down (scale in). Returns the seconds taken.
        ValueError if it is not a live instance or the last one taking requests."""
        front = self.front
        if not isinstance(front, DrainFront):
            raise ValueError("this front end does not drain instances")
        if instance not in front.live:
            raise ValueError(f"engine instance {instance} is not running")
        if front.live - front.draining - {instance} == set():
            raise ValueError("cannot drain the last instance taking requests")
        start = time.monotonic()
        front.draining.add(instance)
        try:
            while front.runs_on(instance):
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"engine instance {instance} still runs requests after {timeout:.0f}s")
                self.round()
                await asyncio.sleep(self.config.migration_interval_s)
        except BaseException:
            front.draining.discard(instance)
            raise
        await front.retire(instance)
        logger.info("engine instance %d drained and shut down", instance)
        return time.monotonic() - start
