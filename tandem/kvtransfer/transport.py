"""Point-to-point message transports between engine processes: a small header plus one bulk payload.

Every engine binds one inbox (a ZeroMQ PULL socket) and sends to peers' inboxes through PUSH
sockets it connects on first use. The header is msgpack bytes; the payload (KV blocks) travels
- `zmq`: as a second ZeroMQ frame, sent without a copy on the sender's side (tcp:// between
  hosts, ipc:// on one host);
- `shm`: in a POSIX shared-memory segment the sender fills and the receiver maps, copies out of
  and unlinks; only the header and the segment's name cross the socket (same host only).
Which one an engine uses is `EngineConfig.kv_transport`; `benchmarks/kv_transfer.py` measures them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

KV_TRANSPORTS = ("zmq", "shm")
# Senders split KV into messages of at most this many bytes: past ~8 MiB a message's throughput
# falls on every transport here (fresh receive buffers to page in; benchmarks/kv_transfer.py). It
# also bounds what a live migration's stage gathers in one engine step (one message a step).
MAX_PAYLOAD_BYTES = 4 << 20
# Messages that may queue toward one peer, on each side of the connection, before a send fails (a
# peer that stopped reading, or that nobody listens at, is dead to us).
SEND_HWM = 1024


@dataclass(slots=True)
class Message:
    """One received message; `release()` once the payload has been copied out of."""

    header: bytes
    payload: memoryview | None
    _shm: Any = None

    def release(self) -> None:
        shm, self._shm = self._shm, None
        self.payload = None
        if shm is not None:
            # Unlink first: close() raises while a view of the payload is still alive, and the
            # segment must not outlive the message even then.
            shm.unlink()
            shm.close()


class Transport(Protocol):
    """What the KV plane needs of a transport (`KVTransport` here; the tests' in-memory one)."""

    address: str
    # What the engine loop polls for arrivals (a ZeroMQ socket; None where nothing is polled).
    socket: Any

    def send(self, peer: str, header: bytes, payload: Any = None) -> None: ...

    def recv(self) -> Message | None: ...

    def close(self) -> None: ...


class TransportError(RuntimeError):
    """A message could not be handed to the transport (the peer's queue is full or gone)."""


class KVTransport:
    """An inbox bound at `address`, and senders to other inboxes."""

    kind = "zmq"

    def __init__(self, bind: str) -> None:
        """`bind`: `tcp://HOST` (a free port is picked) or `ipc://PATH`."""
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.PULL)
        # Bounded, so that a sender to an inbox nobody reads runs into SEND_HWM instead of growing
        # this process's memory without limit.
        self.socket.setsockopt(zmq.RCVHWM, SEND_HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        if bind.startswith("tcp://"):
            port = self.socket.bind_to_random_port(bind)
            self.address = f"{bind}:{port}"
        else:
            self.socket.bind(bind)
            self.address = bind
        self._peers: dict[str, Any] = {}

    def _peer(self, address: str) -> Any:
        sock = self._peers.get(address)
        if sock is None:
            zmq = self._zmq
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(address)
            except zmq.ZMQError:
                sock.close()  # an unclosed socket would make close()'s ctx.term() wait forever
                raise
            self._peers[address] = sock
        return sock

    def send(self, peer: str, header: bytes, payload: Any = None) -> None:
        """Queue a message for `peer` (never blocks). `payload`: a C-contiguous buffer or CPU tensor,
        kept alive until sent and not to be written to until then (`zmq` sends it without a copy);
        `b""` arrives as an empty payload, None as no payload."""
        zmq = self._zmq
        frames = [header] if payload is None else [header, self._wrap(_as_buffer(payload))]
        sent = False
        try:
            self._peer(peer).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            sent = True
        except zmq.Again as exc:
            raise TransportError(f"KV peer {peer} is not taking messages") from exc
        finally:
            if not sent and len(frames) > 1:
                self._discard(frames[1])

    def _wrap(self, payload: Any) -> Any:
        return payload

    def _discard(self, frame: Any) -> None:
        """Undo `_wrap` for a message that was not queued."""

    def recv(self) -> Message | None:
        """The next message if one has arrived (never blocks)."""
        zmq = self._zmq
        try:
            frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        header = frames[0].bytes
        if len(frames) == 1:
            return Message(header, None)
        return self._unwrap(header, frames[1])

    def _unwrap(self, header: bytes, frame: Any) -> Message:
        return Message(header, frame.buffer)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self.socket.close(linger=0)
        self._ctx.term()


class ShmTransport(KVTransport):
    """Payloads through a shared-memory segment per message; the socket carries header and name.

    The receiver unlinks a segment when it releases the message (or its resource tracker does, if
    it dies first). A message still queued when its receiver never takes it (a dead peer; `close()`
    with messages in flight) leaves its segment in /dev/shm: the sender cannot tell which of its
    queued names were delivered."""

    kind = "shm"

    def _wrap(self, payload: Any) -> Any:
        from multiprocessing import shared_memory

        src = memoryview(payload).cast("B")
        name = f"tandem-kv-{os.getpid()}-{secrets.token_hex(6)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, src.nbytes))
        _untrack(shm)
        try:
            _buffer(shm)[: src.nbytes] = src
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close()
        return f"{name}:{src.nbytes}".encode()

    def _unwrap(self, header: bytes, frame: Any) -> Message:
        from multiprocessing import shared_memory

        name, size = frame.bytes.decode().rsplit(":", 1)
        # Tracked in this process (attaching registers it, unlink() in release() unregisters it), so
        # that its resource tracker unlinks the segment if this process dies before releasing.
        shm = shared_memory.SharedMemory(name=name)
        return Message(header, _buffer(shm)[: int(size)], shm)

    def _discard(self, frame: Any) -> None:
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(name=frame.decode().rsplit(":", 1)[0])
        shm.unlink()
        shm.close()


def _as_buffer(payload: Any) -> Any:
    """A torch tensor as its bytes (tensors have no buffer interface; bfloat16 has no numpy dtype)."""
    if not type(payload).__module__.startswith("torch"):
        return payload
    import torch

    if not isinstance(payload, torch.Tensor):
        return payload
    return payload.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _buffer(shm: Any) -> memoryview:
    buf = shm.buf
    assert buf is not None, "the segment is closed"
    return buf


def _untrack(shm: Any) -> None:
    """Keep Python's resource tracker out of it: the receiver unlinks what the sender created, and
    the tracker would report (and unlink) segments it saw created but not unlinked by its process."""
    from multiprocessing import resource_tracker

    # The tracker may not know the segment (nothing to undo then).
    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")


def make_transport(kind: str, bind: str) -> KVTransport:
    if kind == "zmq":
        return KVTransport(bind)
    if kind == "shm":
        return ShmTransport(bind)
    raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {kind!r}")
