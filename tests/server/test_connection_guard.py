"""The connection guard (tandem/entrypoints/openai/connections.py) over both uvicorn HTTP protocols:
a real uvicorn server on loopback with a small ASGI app, raw sockets as clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from tandem.entrypoints.openai.connections import (
    MAX_HEADER_BYTES,
    ConnectionLimits,
    ConnectionTable,
    guarded_protocol,
    http_implementation,
)

IMPLEMENTATIONS = ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    http_implementation() != "httptools", reason="httptools is not installed"))]


async def _echo_length(scope: Any, receive: Any, send: Any) -> None:
    """Answers with the number of body bytes it read."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"received": size}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def _server(implementation: str, limits: ConnectionLimits) -> AsyncIterator[tuple[int, ConnectionTable]]:
    table = ConnectionTable(limits)
    config = uvicorn.Config(_echo_length, host="127.0.0.1", port=0, log_level="critical", lifespan="off",
                            http=guarded_protocol(table, implementation))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield server.servers[0].sockets[0].getsockname()[1], table
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _exchange(port: int, data: bytes, wait: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    with contextlib.suppress(ConnectionResetError):  # the server answered and closed before taking all
        await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(1 << 20), wait)
    finally:
        writer.close()


def _request(body: bytes = b"", extra: bytes = b"") -> bytes:
    return (b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + extra
            + b"\r\n" + body)


def _status_and_json(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_guard_bounds_connections_and_headers(implementation):
    limits = ConnectionLimits(max_connections=64, max_per_client=3, header_timeout_s=0.5)

    async def scenario() -> None:
        async with _server(implementation, limits) as (port, table):
            # An ordinary request, and a 200 KB body in the same write as its headers: the body's
            # bytes are not taken for headers.
            for body in (b"{}", b"x" * 200_000):
                status, payload = _status_and_json(await _exchange(port, _request(body)))
                assert (status, payload) == (200, {"received": len(body)})
            # Two pipelined requests in one write: both answered, in order.
            reply = await _exchange(port, _request(b"ab") + _request(b"abc"), wait=2.0)
            assert reply.count(b"HTTP/1.1 200") == 2 and reply.index(b'"received": 2') < reply.index(b'"received": 3')
            # Headers streaming past the bound (a megabyte: many reads): a 4xx in OpenAI's shape, and
            # closed without waiting for the rest.
            huge = _request(extra=b"x-big: " + b"h" * (64 * MAX_HEADER_BYTES) + b"\r\n")
            status, payload = _status_and_json(await _exchange(port, huge))
            assert 400 <= status < 500 and set(payload["error"]) >= {"message", "type", "code"}
            # Headers that never finish: 408 after the deadline.
            status, payload = _status_and_json(await _exchange(port, b"POST /x HTTP/1.1\r\nhost: t\r\n"))
            assert status == 408 and payload["error"]["code"] == "timeout"
            # A fourth connection from one client past its bound of three gets a 503 answer.
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert table.total == 3
            status, payload = _status_and_json(await _exchange(port, _request(b"{}")))
            assert status == 503 and payload["error"]["code"] == "overloaded"
            for _, writer in held:
                writer.close()
            for _ in range(100):  # every connection is counted off once closed
                if table.total == 0 and table.refusing == 0:
                    break
                await asyncio.sleep(0.02)
            assert (table.total, table.refusing, table.per_client) == (0, 0, {})
            assert table.refused == 1

    asyncio.run(scenario())
