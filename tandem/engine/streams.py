"""The front end's streams: how each request's outputs reach its caller.

A `RequestStream` is a mailbox holding the latest cumulative `RequestOutput` (a newer one replaces
an unread one, so a slow reader costs no memory), or the delta outputs not read yet, joined when
read (RequestOutputKind.DELTA), plus an `asyncio.Event` that the caller waits on (one event may
serve several streams). `Streams` holds the open ones, one per request in flight: a request's
stream and text state belong to the front end, not to the instance that runs it, so they stay
where they are when the request moves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.outputs import RequestOutput, coalesce


class RequestAbortedError(RuntimeError):
    """The server ended the request (shutdown drain timed out)."""


class RequestFailedError(RuntimeError):
    """The engine or the front end failed this request alone; the others go on."""


class RequestStream:
    __slots__ = ("_unread", "error", "finished", "notify", "on_finish", "request_id", "started")

    def __init__(
        self,
        request_id: str,
        notify: asyncio.Event,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.notify = notify
        # Called with the final output as soon as it arrives, whether or not anyone reads it.
        self.on_finish = on_finish
        # The newest cumulative output, or the delta outputs not read yet (RequestOutput.delta).
        self._unread: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.finished = False
        self.started = False  # has produced output (no longer waiting, as the API process sees it)

    def put(self, out: RequestOutput) -> None:
        if not out.delta:
            self._unread.clear()
        self._unread.append(out)
        self.started = True
        self.finished = out.finished
        self.notify.set()
        if out.finished and self.on_finish is not None:
            self.on_finish(out)

    def fail(self, exc: BaseException) -> None:
        if not self.finished:
            self.error = exc
            self.finished = True
            self.notify.set()

    def take(self) -> RequestOutput | None:
        """The newest unread output (unread deltas joined into one), or None; raises the stream's
        error once outputs are read."""
        unread, self._unread = self._unread, []
        out = coalesce(unread) if unread else None
        if self.error is not None:
            if out is None:
                raise self.error
            # An output arrived before the failure: the reader waits on `notify` for the error.
            self.notify.set()
        return out


class Streams(dict[str, RequestStream]):
    """The open streams, by request id (a request's stream is open from its admission until its
    final output or its failure)."""

    @property
    def num_waiting(self) -> int:
        """Accepted requests with no output yet, as this process sees them."""
        return sum(1 for s in self.values() if not s.started)

    def deliver(self, out: RequestOutput) -> bool:
        """`out` to its stream (its error, if it carries one); True if that ended the stream."""
        stream = self.get(out.request_id)
        if stream is None:
            return False
        if out.error is not None:
            stream.fail(RequestFailedError(out.error))
        else:
            stream.put(out)
        if out.finished:
            del self[out.request_id]
            return True
        return False

    def fail(self, request_id: str, error: BaseException) -> None:
        """Close the request's stream with `error` (if it is open)."""
        stream = self.pop(request_id, None)
        if stream is not None:
            stream.fail(error)
