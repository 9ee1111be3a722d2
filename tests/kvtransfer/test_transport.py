"""KV transports (tandem/kvtransfer/transport.py): bytes, order and cleanup, in one process and
between two; sends that must fail fast instead of blocking."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kv_echo_peer import STOP, serve

from tandem.kvtransfer.transport import (
    KV_TRANSPORTS,
    SEND_HWM,
    KVTransport,
    Message,
    TransportError,
    make_transport,
)

SHM_DIR = Path("/dev/shm")
# The default model's KV layout: (layers, K and V, blocks, block size, kv heads, head dim).
KV_SHAPE = (8, 2, 3, 16, 1, 64)
BINDS = ("tcp", "ipc")


def bind_address(scheme: str, tmp_path: Path, name: str) -> str:
    return "tcp://127.0.0.1" if scheme == "tcp" else f"ipc://{tmp_path / name}"


def segments(*pids: int) -> list[str]:
    """Shared-memory segments that ShmTransport made in these processes and nobody unlinked."""
    prefixes = tuple(f"tandem-kv-{pid}-" for pid in pids)
    return sorted(p.name for p in SHM_DIR.glob("tandem-kv-*") if p.name.startswith(prefixes))


def receive(transport: KVTransport, timeout: float = 10.0) -> Message:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = transport.recv()
        if msg is not None:
            return msg
        transport.socket.poll(50)
    raise AssertionError(f"no message within {timeout} s")


def take(transport: KVTransport) -> tuple[bytes, bytes | None]:
    """The next message's header and a copy of its payload, released."""
    msg = receive(transport)
    payload = None if msg.payload is None else bytes(msg.payload)
    msg.release()
    return msg.header, payload


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def kv_tensor(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def as_tensor(payload: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=like.dtype).view(like.shape)


def cases() -> list[tuple[bytes, Any, Any]]:
    """(header, payload to send, what must arrive: bytes, a tensor, or None for no payload)."""
    out: list[tuple[bytes, Any, Any]] = [(b"none", None, None), (b"empty", b"", b"")]
    for i, size in enumerate((1, 64 * 1024, 8 * 1024 * 1024)):
        data = random_bytes(size, seed=i)
        out.append((f"bytes-{size}".encode(), data, data))
    for dtype in (torch.bfloat16, torch.float32):
        t = kv_tensor(dtype, seed=7)
        out.append((f"tensor-{dtype}".encode(), t, t))
        out.append((f"bytes-of-{dtype}".encode(), t.view(torch.uint8).numpy(), t))
        # Not contiguous: it arrives as its contiguous copy.
        out.append((f"transposed-{dtype}".encode(), t.transpose(0, 2), t.transpose(0, 2).contiguous()))
    return out


def check(header: bytes, got: bytes | None, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert got is not None, header
        assert torch.equal(as_tensor(got, expected), expected), header
    else:
        assert got == expected, header


@pytest.fixture
def no_leftover_segments() -> Iterator[list[int]]:
    """Yields a list the test adds its child processes' pids to; fails if any segment made by this
    process or those is still there afterwards."""
    pids = [os.getpid()]
    before = set(segments(*pids))
    yield pids
    assert set(segments(*pids)) - before == set()


@pytest.fixture(params=[(k, b) for k in KV_TRANSPORTS for b in BINDS], ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path: Path, no_leftover_segments) -> Iterator[tuple[KVTransport, KVTransport]]:
    """(sender, receiver) of one kind in this process, the receiver bound over tcp or ipc."""
    kind, scheme = request.param
    sender = make_transport(kind, bind_address(scheme, tmp_path, "sender"))
    receiver = make_transport(kind, bind_address(scheme, tmp_path, "receiver"))
    yield sender, receiver
    sender.close()
    receiver.close()


def test_payloads_arrive_byte_identical(pair):
    sender, receiver = pair
    for header, payload, expected in cases():
        sender.send(receiver.address, header, payload)
        got_header, got = take(receiver)
        assert got_header == header
        check(header, got, expected)


def test_many_messages_keep_their_order(pair):
    sender, receiver = pair
    # Some above pyzmq's 64 KiB copy threshold (sent without a copy), most below it.
    sizes = [100 * 1024 if i % 25 == 0 else i % 300 for i in range(300)]
    for i, size in enumerate(sizes):
        sender.send(receiver.address, b"%d" % i, random_bytes(size, seed=i) if i % 7 else None)
    for i, size in enumerate(sizes):
        header, payload = take(receiver)
        assert header == b"%d" % i
        assert payload == (random_bytes(size, seed=i) if i % 7 else None)


@pytest.mark.parametrize("scheme", BINDS)
@pytest.mark.parametrize("kind", KV_TRANSPORTS)
def test_between_two_processes(kind: str, scheme: str, tmp_path: Path, no_leftover_segments):
    """Everything goes to a spawned process and comes back: payloads intact, in order."""
    parent = make_transport(kind, bind_address(scheme, tmp_path, "parent"))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child_bind = bind_address(scheme, tmp_path, "child")
    child = ctx.Process(target=serve, args=(kind, child_bind, parent.address, theirs, 60.0), daemon=True)
    child.start()
    no_leftover_segments.append(child.pid)
    try:
        assert ours.poll(30), "the child process did not start"
        peer = ours.recv()
        sent = cases() + [
            (b"seq-%d" % i, random_bytes(i, seed=i), random_bytes(i, seed=i)) for i in range(200)
        ]
        for header, payload, _ in sent:
            parent.send(peer, header, payload)
        for header, _, expected in sent:
            got_header, got = take(parent)
            assert got_header == header
            check(header, got, expected)
        parent.send(peer, STOP)
        assert ours.poll(10) and ours.recv() == "done"
        child.join(10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        parent.close()


@pytest.mark.parametrize("kind", KV_TRANSPORTS)
def test_release_unlinks_the_segment(kind: str, no_leftover_segments):
    sender, receiver = make_transport(kind, "tcp://127.0.0.1"), make_transport(kind, "tcp://127.0.0.1")
    try:
        sender.send(receiver.address, b"h", b"abc")
        msg = receive(receiver)
        assert len(segments(os.getpid())) == (1 if kind == "shm" else 0)
        assert bytes(msg.payload or b"") == b"abc"
        msg.release()
        assert msg.payload is None
        assert segments(os.getpid()) == []
        msg.release()  # twice is harmless
    finally:
        sender.close()
        receiver.close()


def test_release_unlinks_even_while_the_payload_is_still_viewed(no_leftover_segments):
    sender, receiver = make_transport("shm", "tcp://127.0.0.1"), make_transport("shm", "tcp://127.0.0.1")
    try:
        sender.send(receiver.address, b"h", b"abc")
        msg = receive(receiver)
        view = np.frombuffer(msg.payload, np.uint8)  # a caller that forgot to drop its view
        with pytest.raises(BufferError) as raised:
            msg.release()
        assert segments(os.getpid()) == []
        # The traceback holds the segment's mapping: it may close once the view is gone.
        del view
        del raised
    finally:
        sender.close()
        receiver.close()


def dead_tcp_peer() -> tuple[str, socket.socket]:
    """An address nobody listens at: a port bound (so nothing else takes it) but not listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return f"tcp://127.0.0.1:{sock.getsockname()[1]}", sock


@pytest.mark.parametrize("scheme", BINDS)
@pytest.mark.parametrize("kind", KV_TRANSPORTS)
def test_sends_to_a_dead_peer_fail_fast(kind: str, scheme: str, tmp_path: Path):
    placeholder = None
    if scheme == "tcp":
        peer, placeholder = dead_tcp_peer()
    else:
        peer = f"ipc://{tmp_path / 'nobody'}"
    transport = make_transport(kind, "tcp://127.0.0.1")
    before = set(segments(os.getpid()))
    start = time.monotonic()
    sent = failed = 0
    try:
        for _ in range(SEND_HWM + 10):
            try:
                transport.send(peer, b"h", b"x" * 1024)
                sent += 1
            except TransportError:
                failed += 1
        assert time.monotonic() - start < 5
        assert failed >= 10 and sent <= SEND_HWM
        if kind == "shm":
            # A failed send leaves no segment; the queued ones stay until a receiver takes them
            # (this peer never will: a known leak, see ShmTransport).
            left = set(segments(os.getpid())) - before
            assert len(left) == sent
            for name in left:
                (SHM_DIR / name).unlink()
    finally:
        transport.close()
        if placeholder is not None:
            placeholder.close()


@pytest.mark.parametrize("scheme", BINDS)
def test_a_peer_that_stopped_reading_is_dead_to_us(scheme: str, tmp_path: Path):
    """Its inbox is bounded too: once both queues are full, sends keep failing even after a pause in
    which a reading peer would have drained them."""
    sender = make_transport("zmq", "tcp://127.0.0.1")
    receiver = make_transport("zmq", bind_address(scheme, tmp_path, "receiver"))
    payload = bytes(16 * 1024)
    accepted = []
    try:
        for _ in range(6):
            n = 0
            while n < 4 * SEND_HWM:
                try:
                    sender.send(receiver.address, b"h", payload)
                except TransportError:
                    break
                n += 1
            accepted.append(n)
            if n == 0:
                break
            time.sleep(0.2)
        assert accepted[-1] == 0, accepted
        assert sum(accepted) < 8 * SEND_HWM
    finally:
        sender.close()
        receiver.close()


def test_send_to_a_malformed_address_raises_and_close_still_returns():
    transport = make_transport("zmq", "tcp://127.0.0.1")
    # Kept alive on purpose: the traceback references what the failed send created, and a socket
    # left open there would make close() wait forever.
    with pytest.raises(Exception, match="nonsense") as raised:
        transport.send("nonsense", b"h")
    closer = threading.Thread(target=transport.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "close() hangs"
    del raised


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kv_transport") as raised:
        make_transport("bogus", "tcp://127.0.0.1")
    assert "bogus" in str(raised.value) and "zmq" in str(raised.value)
