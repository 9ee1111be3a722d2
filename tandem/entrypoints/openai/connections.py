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


class _Guard:
    """The bounds and the header deadline, over either uvicorn HTTP protocol (listed first among
    the bases; `guarded_protocol` sets the table and the deadline)."""

    table: ConnectionTable
    header_timeout_s: float
    # Provided by the uvicorn protocol class.
    client: Any
    transport: Any
    loop: Any
    app: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counted: str | None = None
        self._refused = False
        self._header_timer: Any = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        table = self.table
        client = self.client[0] if self.client else ""
        refusal = table.open(client)
        if refusal is None:
            self._counted = client
            self._arm(self.header_timeout_s)
            return
        if table.refusing >= table.limits.max_connections:
            transport.close()  # refusing too many already: no answer at all
            return
        # Answer its request with 503 (a response sent before the request can be lost to the
        # client as a reset), then close.
        table.refusing += 1
        self._refused = True
        self.app = _refusal_app(refusal)
        self._arm(min(self.header_timeout_s, REFUSAL_GRACE_S))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted is not None:
            self.table.close(self._counted)
            self._counted = None
        if self._refused:
            self.table.refusing -= 1
            self._refused = False
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        # The next request's headers have the same deadline (armed first: a pipelined request
        # already buffered starts inside the call below, which disarms it again).
        self._arm(self.header_timeout_s)
        super().on_response_complete()  # type: ignore[misc]

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
            self.transport.write(_raw_response(408, "Request Timeout", "the request headers took too long", "timeout"))
            self.transport.close()


# Bytes of request line and headers a request may send: h11's bound, which uvicorn's h11 protocol
# applies (httptools' parser has none and would buffer whatever arrives until the deadline).
MAX_HEADER_BYTES = 16 * 1024


def _h11_guard() -> type:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(_Guard, H11Protocol):
        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()

    return GuardedH11Protocol


def _httptools_guard() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        # Bytes received since the current request's headers began; None while a body is read.
        _header_bytes: int | None = 0

        def data_received(self, data: bytes) -> None:
            if self._header_bytes is not None:
                # Counted before feeding: a chunk that completes the headers may carry body bytes.
                if self._header_bytes > MAX_HEADER_BYTES:
                    self.send_400_response("the request headers are too large")
                    return
                self._header_bytes += len(data)
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._header_bytes = None
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._header_bytes = 0  # a pipelined request's headers may follow in the same chunk
            super().on_message_complete()

    return GuardedHttpToolsProtocol


def http_implementation() -> str:
    """The HTTP parser the server runs: httptools (C, llhttp) where it is installed, else h11
    (pure Python: about twice the API process's CPU a streamed token)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def guarded_protocol(table: ConnectionTable, implementation: str | None = None) -> type:
    """uvicorn's HTTP protocol class (`implementation`: "httptools" or "h11"; unset:
    `http_implementation()`), with `table`'s bounds and the header deadline."""
    base = _httptools_guard() if (implementation or http_implementation()) == "httptools" else _h11_guard()
    return type(base.__name__, (base,), {"table": table, "header_timeout_s": table.limits.header_timeout_s})
