"""An engine's side of KV transfers: its inbox, and the sender and receiver ends over it.

The engine loop polls `socket` with its own input and calls `handle()` when it is readable,
`after_step()` after each engine step (a transfer's next message, next stage, or hand-over) and
`tick()` on every pass (timeouts). What the front end must hear goes through `report` (`Migrated`
from a source, `TransferDropped` from a destination), so it follows the request's last outputs on
the same channel. The plane sees its engine only through `KVHost` (host.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tandem.config import EngineConfig
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.host import KVHost
from tandem.kvtransfer.receiver import Receiver
from tandem.kvtransfer.sender import Sender
from tandem.kvtransfer.transport import Transport, make_transport


def inbox_address(engine_in_addr: str) -> str:
    """Where an engine fed from `engine_in_addr` binds its KV inbox: the same host (a free port)
    for tcp://, a socket file beside it for ipc://."""
    if engine_in_addr.startswith("tcp://"):
        return engine_in_addr.rsplit(":", 1)[0]
    if engine_in_addr.startswith("ipc://"):
        return engine_in_addr.rsplit("/", 1)[0] + "/kv"
    raise ValueError(f"cannot place a KV inbox beside {engine_in_addr!r}")


class KVPlane:
    def __init__(
        self,
        host: KVHost,
        transport: Transport,
        report: Callable[[p.Migrated | p.TransferDropped], None],
        *,
        timeout_s: float,
        max_stages: int,
        stop_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        log: p.MoveLog | None = None,
    ) -> None:
        self.transport = transport
        self.address = transport.address
        self.socket = transport.socket
        self._enc = p.encoder()
        self._dec = p.decoder()
        self.sender = Sender(
            host,
            self.address,
            self._send,
            report,
            timeout_s=timeout_s,
            max_stages=max_stages,
            stop_blocks=stop_blocks,
            clock=clock,
            log=log,
        )
        self.receiver = Receiver(host, self._send, report, timeout_s=timeout_s, clock=clock, log=log)

    @classmethod
    def open(
        cls,
        host: KVHost,
        config: EngineConfig,
        bind: str,
        report: Callable[[p.Migrated | p.TransferDropped], None],
        clock: Callable[[], float] = time.monotonic,
        log: p.MoveLog | None = None,
    ) -> KVPlane:
        """A plane with the transport and the transfer settings `config` names, its inbox at `bind`;
        `log`: where it notes each act of a move (the engine's step trace)."""
        return cls(
            host,
            make_transport(config.kv_transport, bind),
            report,
            timeout_s=config.kv_transfer_timeout_s,
            max_stages=config.migration_max_stages,
            stop_blocks=config.migration_stop_blocks,
            clock=clock,
            log=log,
        )

    @property
    def active(self) -> bool:
        return self.sender.active or self.receiver.active

    def _send(self, peer: str, msg: Any, payload: Any) -> None:
        self.transport.send(peer, self._enc.encode(msg), payload)

    def handle(self) -> None:
        """Act on every message that has arrived."""
        while (msg := self.transport.recv()) is not None:
            try:
                self._dispatch(self._dec.decode(msg.header), msg.payload)
            finally:
                msg.release()

    def _dispatch(self, msg: p.PeerMessage, payload: memoryview | None) -> None:
        match msg:
            case p.Blocks():
                self.receiver.on_blocks(msg, payload)
            case p.Begin():
                self.receiver.on_begin(msg)
            case p.Handover():
                self.receiver.on_handover(msg, payload)
            case p.Cancel():
                self.receiver.on_cancel(msg)
            case p.Accepted():
                self.sender.on_accepted(msg)
            case p.Staged():
                self.sender.on_staged(msg)
            case p.Installed():
                self.sender.on_installed(msg)

    def after_step(self) -> None:
        """After an engine step: transfers copying send on, or hand their request over."""
        self.sender.after_step()

    def tick(self) -> bool:
        """Timeouts; True if a reservation was released (the load report is stale)."""
        self.sender.tick()
        return self.receiver.tick()

    def close(self) -> None:
        self.transport.close()
