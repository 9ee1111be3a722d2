"""The other process of test_transport.py's two-process tests: echoes every message back.

Kept apart from the test module so that the spawned child imports neither torch nor pytest.
"""

from __future__ import annotations

import time
from typing import Any

from tandem.kvtransfer.transport import make_transport

STOP = b"stop"


def serve(kind: str, bind: str, reply_to: str, conn: Any, timeout: float) -> None:
    """Send our inbox's address over `conn`, then echo each message to `reply_to` until `STOP` (or
    `timeout` seconds without one: the parent died or lost track)."""
    transport = make_transport(kind, bind)
    try:
        conn.send(transport.address)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not transport.socket.poll(100):
                continue
            msg = transport.recv()
            if msg is None:
                continue
            if msg.header == STOP:
                msg.release()
                break
            payload = None if msg.payload is None else bytes(msg.payload)
            msg.release()
            transport.send(reply_to, msg.header, payload)
        conn.send("done")
    finally:
        transport.close()
