"""HTTP connections: a bound on them in all and per client, and a deadline for a request's headers.

uvicorn keeps a connection that never sends a byte open forever, and its own concurrency limit
counts such connections, so a client holding idle sockets can lock every other client out (and
gets them plain-text 503s). Here each connection is counted against its client's address when it
opens; one past a bound is not counted: its request (given a short deadline) is answered with an
OpenAI-style 503, and it is closed. A connection whose
request headers have not all arrived within `header_timeout_s` of it opening, or of its previous
response ending, is closed. Request bodies have their own deadline (`GuardMiddleware`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tandem.server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    # Open connections in all; past it new ones get 503.
    max_connections: int = 1536
    # Open connections from one client address; 0 = unbounded (e.g. behind a proxy, where every
    # client has the proxy's address).
    max_per_client: int = 768
    # Seconds for a request's headers to arrive, from the connection's start or its previous response.
    header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.max_per_client < 0:
            raise ValueError(f"--max-connections-per-client must be 0 or more, got {self.max_per_client}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"--header-timeout must be positive, got {self.header_timeout_s}")


@dataclass(slots=True)
class ConnectionTable:
    """Open connections, in all and per client address."""

    limits: ConnectionLimits
    total: int = 0
    per_client: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    # Refused connections still open (their request is being answered 503); bounded as well.
    refusing: int = 0

    def open(self, client: str) -> str | None:
        """Count a new connection; or the reason it is refused (then nothing is counted)."""
        held = self.per_client.get(client, 0)
        if self.total >= self.limits.max_connections:
            reason = f"the server has too many open connections ({self.total})"
        elif self.limits.max_per_client and held >= self.limits.max_per_client:
            reason = f"too many open connections from this client ({held})"
        else:
            self.total += 1
            self.per_client[client] = held + 1
            return None
        self.refused += 1
        return reason

    def close(self, client: str) -> None:
        self.total -= 1
        left = self.per_client[client] - 1
        if left:
            self.per_client[client] = left
        else:
            del self.per_client[client]


def _raw_response(status: int, reason: str, message: str, code: str | None) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    ).encode()
    return head + b"\r\n" + body


# Seconds a refused connection has to send its request (which gets 503) before it is closed.
REFUSAL_GRACE_S = 2.0


def _refusal_app(message: str) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = json.dumps(
            {"error": {"message": message, "type": "server_error", "param": None, "code": "overloaded"}}
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def guarded_protocol(table: ConnectionTable) -> type:
    """uvicorn's h11 protocol class, with `table`'s bounds and the header deadline."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout = table.limits.header_timeout_s

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._counted: str | None = None
            self._refused = False
            self._header_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            client = self.client[0] if self.client else ""
            refusal = table.open(client)
            if refusal is None:
                self._counted = client
                self._arm(timeout)
                return
            if table.refusing >= table.limits.max_connections:
                transport.close()  # refusing too many already: no answer at all
                return
            # Answer its request with 503 (a response sent before the request can be lost to the
            # client as a reset), then close.
            table.refusing += 1
            self._refused = True
            self.app = _refusal_app(refusal)
            self._arm(min(timeout, REFUSAL_GRACE_S))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted is not None:
                table.close(self._counted)
                self._counted = None
            if self._refused:
                table.refusing -= 1
                self._refused = False
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            # The next request's headers have the same deadline (armed first: a pipelined request
            # already buffered starts inside the call below, which disarms it again).
            self._arm(timeout)
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:
            # Malformed HTTP or oversized headers: answered in OpenAI's error shape, then closed.
            self.transport.write(_raw_response(400, "Bad Request", msg, None))
            self.transport.close()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.write(
                    _raw_response(408, "Request Timeout", "the request headers took too long", "timeout")
                )
                self.transport.close()

    return GuardedH11Protocol
