"""An engine's side of KV transfers: its inbox, and the sender and receiver ends over it.

The engine loop polls `socket` with its own input, calls `handle()` when it is readable and `tick()`
after each step (stages, hand-overs, timeouts); what the front end must hear (`Migrated`) goes
through `report` (`Migrated` from a source, `TransferDropped` from a destination), so it follows
the request's last outputs on the same channel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.kvtransfer import wire
from tandem.kvtransfer.receiver import Receiver
from tandem.kvtransfer.sender import Sender
from tandem.kvtransfer.transport import make_transport

if TYPE_CHECKING:
    from tandem.engine.core import EngineCore


def inbox_address(engine_in_addr: str) -> str:
    """Where an engine fed from `engine_in_addr` binds its KV inbox: the same host (a free port)
    for tcp://, a socket file beside it for ipc://."""
    if engine_in_addr.startswith("tcp://"):
        return engine_in_addr.rsplit(":", 1)[0]
    if engine_in_addr.startswith("ipc://"):
        return engine_in_addr.rsplit("/", 1)[0] + "/kv"
    raise ValueError(f"cannot place a KV inbox beside {engine_in_addr!r}")


class KVPlane:
    def __init__(self, core: EngineCore, bind: str, report: Callable[[Any], None]) -> None:
        self.transport = make_transport(core.config.kv_transport, bind)
        self.address = self.transport.address
        self.socket = self.transport.socket
        self._enc = wire.encoder()
        self._dec = wire.decoder()
        self.sender = Sender(core, self.address, self._send, report)
        self.receiver = Receiver(core, self._send, report)

    @property
    def active(self) -> bool:
        return self.sender.active or self.receiver.active

    def _send(self, peer: str, msg: Any, payload: Any) -> None:
        if payload is not None:
            payload = memoryview(payload.contiguous().view(-1).view(dtype=_byte_dtype()).numpy())
        self.transport.send(peer, self._enc.encode(msg), payload)

    def handle(self) -> None:
        """Act on every message that has arrived."""
        while (msg := self.transport.recv()) is not None:
            try:
                self._dispatch(self._dec.decode(msg.header), msg.payload)
            finally:
                msg.release()

    def _dispatch(self, msg: Any, payload: memoryview | None) -> None:
        if isinstance(msg, wire.Blocks):
            self.receiver.on_blocks(msg, payload)
        elif isinstance(msg, wire.Begin):
            self.receiver.on_begin(msg)
        elif isinstance(msg, wire.Handover):
            self.receiver.on_handover(msg, payload)
        elif isinstance(msg, wire.Cancel):
            self.receiver.on_cancel(msg)
        elif isinstance(msg, wire.Accepted):
            self.sender.on_accepted(msg)
        elif isinstance(msg, wire.Installed):
            self.sender.on_installed(msg)

    def tick(self) -> bool:
        """Advance transfers; True if a reservation was released (the load report is stale)."""
        self.sender.tick()
        return self.receiver.tick()

    def close(self) -> None:
        self.transport.close()


def _byte_dtype() -> Any:
    import torch

    return torch.uint8
