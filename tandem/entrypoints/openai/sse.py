"""A server-sent-events response that always cleans up after its request."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse


class SSEResponse(StreamingResponse):
    def __init__(self, content: Any, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # On a client disconnect Starlette cancels the sending task, and the generator may be
            # left suspended at a `yield`, or never started if the client left before the headers
            # went out. Close it now and end its engine requests (`on_close` is idempotent).
            body = self.body_iterator
            if isinstance(body, AsyncGenerator):  # our streams are; Starlette's type does not say so
                await body.aclose()
            self.on_close()
