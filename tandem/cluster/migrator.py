"""Runs the migration policy against a live front end: every round, the rebalancer's moves are
started on the engine client (live, or by recompute); `drain` empties an instance and retires it."""

from __future__ import annotations

import asyncio
import logging
import time

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.cluster.rebalance import Rebalancer, RequestView
from tandem.engine.core_client import AsyncEngineClient

logger = logging.getLogger("tandem.cluster")


class Migrator:
    def __init__(self, config: ClusterConfig, client: AsyncEngineClient) -> None:
        self.config = config
        self.client = client
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
        client = self.client
        dispatcher = client.dispatcher
        if not isinstance(dispatcher, Dispatcher) or client.dead is not None:
            return 0
        views = []
        for rid, instance in client.routes.items():
            req = client.requests.get(rid)
            stream = client.streams.get(rid)
            if req is None or stream is None or rid in client.moves:
                continue
            demand = dispatcher.demand_of(rid)
            seq = client.seqs.get(rid, 0)
            views.append(RequestView(rid, instance, req.priority, stream.started, seq, demand, req.params.n))
        # Seats the moves under way will take at their destinations (reserved there once accepted).
        incoming: dict[int, int] = {}
        for rid, mv in client.moves.items():
            moved = client.requests.get(rid)
            incoming[mv.destination] = incoming.get(mv.destination, 0) + (moved.params.n if moved else 1)
        live = client.live
        pd = client.disaggregation
        if pd is not None:  # prefill instances hand their requests off on their own
            live &= set(pd.decode) | client.draining
            views = [v for v in views if v.instance in live]
        plan = self.rebalancer.plan(dispatcher.instances, live, client.draining, views, len(client.moves), incoming)
        started = 0
        for rid, dest in plan:
            ok = client.migrate_live(rid, dest) if self.config.migration_mode == "live" else client.migrate_by_recompute(rid, dest)
            started += ok
        return started

    async def drain(self, instance: int, timeout: float = 600.0) -> float:
        """Move every request off `instance`, then shut it down (scale in). Returns the seconds taken.
        ValueError if it is not a live instance or the last one taking requests."""
        client = self.client
        if instance not in client.live:
            raise ValueError(f"engine instance {instance} is not running")
        if client.dispatchable - {instance} == set():
            raise ValueError("cannot drain the last instance taking requests")
        start = time.monotonic()
        client.draining.add(instance)
        try:
            while any(i == instance for i in client.routes.values()) or any(
                mv.source == instance or mv.destination == instance for mv in client.moves.values()
            ):
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"engine instance {instance} still runs requests after {timeout:.0f}s")
                self.round()
                await asyncio.sleep(self.config.migration_interval_s)
        except BaseException:
            client.draining.discard(instance)
            raise
        await client.retire(instance)
        logger.info("engine instance %d drained and shut down", instance)
        return time.monotonic() - start
