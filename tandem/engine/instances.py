"""The engine instances a front end talks to: their connections, which of them live, which drain
(live, but taking no new request: scale in), which were retired after a drain, their KV inboxes,
and the one way messages go to them.

Each instance has one output loop (an asyncio task) that reads its messages and hands each to the
front end; when the connection says the instance is gone (dead, or hung past `hang_timeout_s`)
the loop tells the front end once and makes sure the host stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from tandem.engine import messages as m
from tandem.engine.connection import EngineConnection, EngineDeadError

logger = logging.getLogger("tandem.client")


class Instances:
    def __init__(self, connections: list[EngineConnection], hang_timeout_s: float | None = None) -> None:
        self.connections = connections
        # An instance silent this long (after start-up) is taken for hung.
        self.hang_timeout_s = hang_timeout_s
        self.live: set[int] = set()
        # Instances being drained (scale in): live, but no new request goes there.
        self.draining: set[int] = set()
        # Instances shut down after a drain.
        self.retired: set[int] = set()
        # each instance's KV inbox (None: it takes no transfers)
        self.kv_addresses: list[str | None] = []
        self._enc = m.encoder()
        self._tasks: list[asyncio.Task] = []

    @property
    def dispatchable(self) -> set[int]:
        """Live instances that take new requests (not draining)."""
        return self.live - self.draining

    # -- lifecycle -----------------------------------------------------------------------------

    def launch(self) -> None:
        """Start every instance's host (`handshake` waits for them)."""
        for conn in self.connections:
            conn.hang_timeout_s = self.hang_timeout_s
            conn.launch()

    async def handshake(self, extra_eos_token_ids: list[int], timeout: float) -> list[m.Ready]:
        readies = await asyncio.gather(*(c.handshake(extra_eos_token_ids, timeout) for c in self.connections))
        self.kv_addresses = [r.kv_address for r in readies]
        self.live = set(range(len(self.connections)))
        return list(readies)

    def listen(self, handle: Callable[[int, Any], None], died: Callable[[int, str], None]) -> None:
        """Start each instance's output loop: its messages to `handle`, its end to `died`."""
        self._tasks = [
            asyncio.create_task(self._output_loop(i, handle, died), name=f"tandem-engine-outputs-{i}")
            for i in range(len(self.connections))
        ]

    async def _output_loop(
        self, instance: int, handle: Callable[[int, Any], None], died: Callable[[int, str], None]
    ) -> None:
        try:
            while True:
                handle(instance, await self.connections[instance].recv())
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            died(instance, str(exc))
            await self._put_down(instance)
        except Exception as exc:
            logger.exception("engine output loop failed")
            died(instance, f"engine client error: {exc}")
            await self._put_down(instance)

    async def _put_down(self, instance: int) -> None:
        """Make sure an instance given up for dead (it may only be hung) stops."""
        conn = self.connections[instance]
        if conn.exit_reason() is None:
            with contextlib.suppress(Exception):
                await conn.stop_host(1.0)

    async def retire(self, instance: int, timeout: float) -> None:
        """Shut a drained instance down."""
        self.retired.add(instance)
        self.live.discard(instance)
        self.draining.discard(instance)
        if self._tasks:
            task = self._tasks[instance]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.connections[instance].shutdown(timeout)

    async def shutdown(self, timeout: float) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            *(c.shutdown(timeout) for i, c in enumerate(self.connections) if i not in self.retired),
            return_exceptions=True,
        )

    # -- messages ------------------------------------------------------------------------------

    def encode(self, msg: object) -> bytes:
        try:
            return self._enc.encode(msg)
        except (OverflowError, UnicodeError, TypeError) as exc:  # a field msgpack cannot carry
            raise ValueError(f"the request cannot be sent to the engine: {exc}") from exc

    def send(self, instance: int, payload: bytes) -> None:
        """An encoded message to an instance; EngineDeadError if it cannot be reached."""
        self.connections[instance].send(payload)

    def tell(self, instance: int, msg: object) -> None:
        """A control message to an instance; dropped if the instance is gone (it holds nothing)."""
        if instance in self.live:
            with contextlib.suppress(EngineDeadError):
                self.connections[instance].send(self.encode(msg))
