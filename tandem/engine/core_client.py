"""The API process's side of the engine: spawns the engine-core process and talks to it over ZeroMQ.

Text stays here: the client owns the tokenizer, the `InputProcessor` (validation against the
limits the core sends back at start-up) and the `OutputProcessor` (detokenization, stop strings,
logprobs). A stop string found here is sent to the core as `StopSample`.

Each request's outputs reach its caller through a `RequestStream`: a one-slot mailbox holding the
latest cumulative `RequestOutput` (a newer one replaces an unread one, so a slow reader costs no
memory), plus an `asyncio.Event` that the caller waits on (one event may serve several streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from tandem.config import EngineConfig
from tandem.core.limits import EngineLimits
from tandem.engine import messages as m
from tandem.engine.messages import EngineCoreRequest
from tandem.engine.processor import InputProcessor, OutputProcessor
from tandem.engine.tokenizer import Tokenizer
from tandem.outputs import RequestOutput

logger = logging.getLogger("tandem.client")

LIVENESS_POLL_MS = 200


class EngineDeadError(RuntimeError):
    """The engine process has exited; no request can make progress."""


class RequestAbortedError(RuntimeError):
    """The server ended the request (shutdown drain timed out)."""


class RequestFailedError(RuntimeError):
    """The engine or the front end failed this request alone; the others go on."""


class RequestStream:
    __slots__ = ("_latest", "error", "finished", "notify", "on_finish", "request_id", "started")

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
        self._latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.started = False  # has produced output (no longer waiting, as the API process sees it)

    def put(self, out: RequestOutput) -> None:
        self._latest = out
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
        """The newest unread output, or None; raises the stream's error once outputs are read."""
        out, self._latest = self._latest, None
        if out is None and self.error is not None:
            raise self.error
        return out


class AsyncEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: Callable[[m.Stats], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.on_stats = on_stats
        self.on_dead = on_dead
        self.dead: str | None = None
        self.engine_pid: int | None = None
        self.limits: EngineLimits | None = None
        self.tokenizer: Tokenizer | None = None
        self.inputs: InputProcessor | None = None
        self.outputs: OutputProcessor | None = None
        self.streams: dict[str, RequestStream] = {}
        self._enc = m.encoder()
        self._dec = m.client_decoder()
        self._proc: Any = None
        self._tmp: str | None = None
        self._ctx: Any = None
        self._actx: Any = None
        self._in: Any = None
        self._out: Any = None
        self._task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------

    async def start(self, timeout: float = 600.0) -> None:
        """Spawn the engine process, load the tokenizer meanwhile, and wait for the core's limits."""
        import multiprocessing

        import zmq
        import zmq.asyncio

        from tandem.engine.core_proc import run_engine_core

        self._tmp = tempfile.mkdtemp(prefix="tandem-")
        in_addr, out_addr = f"ipc://{self._tmp}/in", f"ipc://{self._tmp}/out"
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._actx = zmq.asyncio.Context()
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.config, in_addr, out_addr, os.getpid()),
            name="tandem-engine-core",
            daemon=True,
        )
        self._proc.start()
        self.engine_pid = self._proc.pid
        loop = asyncio.get_running_loop()
        tok_path = self.config.tokenizer or self.config.model
        self.tokenizer = await loop.run_in_executor(None, Tokenizer, tok_path)
        eos = self.tokenizer.eos_token_id
        await asyncio.wait_for(self._expect(m.Hello), timeout)
        self._send(m.Init([] if eos is None else [eos]))
        ready = await asyncio.wait_for(self._expect(m.Ready), timeout)
        self.limits = ready.limits
        self.inputs = InputProcessor(self.tokenizer, ready.limits)
        self.outputs = OutputProcessor(self.tokenizer)
        self._task = asyncio.create_task(self._output_loop(), name="tandem-engine-outputs")

    async def _expect(self, kind: type) -> Any:
        while True:
            msg = await self._recv()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, m.Failed):
                raise RuntimeError(f"the engine failed to start: {msg.message}")

    async def _recv(self) -> Any:
        """Next message; raises EngineDeadError once the process has exited and nothing is left."""
        while not await self._out.poll(LIVENESS_POLL_MS):
            if not self._proc.is_alive():
                raise EngineDeadError(f"the engine process exited (code {self._proc.exitcode})")
        return self._dec.decode(await self._out.recv(copy=False))

    async def shutdown(self, timeout: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        proc = self._proc
        if proc is not None and proc.is_alive():
            with contextlib.suppress(EngineDeadError):
                self._send(m.Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, proc.join, timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- requests ------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self.streams)

    @property
    def num_waiting(self) -> int:
        """Accepted requests with no output yet, as this process sees them."""
        return sum(1 for s in self.streams.values() if not s.started)

    def add(
        self,
        req: EngineCoreRequest,
        prompt_text: str | None,
        notify: asyncio.Event,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> RequestStream:
        """Queue a request validated by `self.inputs.process`; outputs arrive on the returned stream."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if req.request_id in self.streams:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        stream = RequestStream(req.request_id, notify, on_finish)
        # Registered and sent as one step: whatever fails in between (an unencodable field, a dead
        # engine) unregisters the request, so no error path leaves a stream behind.
        self.streams[req.request_id] = stream
        try:
            self.outputs.add(req, prompt_text)
            payload = self._encode(m.Add(req))
            self._send_bytes(payload)
        except BaseException:
            self.streams.pop(req.request_id, None)
            self.outputs.abort([req.request_id])
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if self.streams.pop(rid, None) is not None]
        if not ids:
            return
        self.outputs.abort(ids)
        if self.dead is None:
            with contextlib.suppress(EngineDeadError):
                self._send(m.Abort(ids))

    def abort_all(self, reason: str) -> None:
        """End every in-flight request with RequestAbortedError (server shutdown)."""
        streams = list(self.streams.values())
        self.abort(list(self.streams))
        for s in streams:
            s.fail(RequestAbortedError(reason))

    def _encode(self, msg: object) -> bytes:
        try:
            return self._enc.encode(msg)
        except (OverflowError, UnicodeError, TypeError) as exc:  # a field msgpack cannot carry
            raise ValueError(f"the request cannot be sent to the engine: {exc}") from exc

    def _send(self, msg: object) -> None:
        self._send_bytes(self._encode(msg))

    def _send_bytes(self, payload: bytes) -> None:
        import zmq

        try:
            self._in.send(payload, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:  # no engine connected any more
            raise EngineDeadError("the engine process is not reachable") from exc

    # -- outputs -------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle(await self._recv())
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._die(str(exc))
        except Exception as exc:
            logger.exception("engine output loop failed")
            self._die(f"engine client error: {exc}")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, m.Outputs):
            if msg.stats is not None and self.on_stats is not None:
                self.on_stats(msg.stats)
            if not msg.outputs:
                return
            outs, stops, failed = self.outputs.process(msg.outputs)
            for request_id, index, reason in stops:
                self._send(m.StopSample(request_id, index, reason))
            if failed:
                self._send(m.Abort(failed))
            for out in outs:
                stream = self.streams.get(out.request_id)
                if stream is None:
                    continue
                if out.error is not None:
                    stream.fail(RequestFailedError(out.error))
                else:
                    stream.put(out)
                if out.finished:
                    del self.streams[out.request_id]
        elif isinstance(msg, m.Rejected):
            stream = self.streams.pop(msg.request_id, None)
            self.outputs.abort([msg.request_id])
            if stream is not None:
                stream.fail(ValueError(msg.message))
        elif isinstance(msg, m.Failed):
            raise EngineDeadError(f"the engine failed: {msg.message}")

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        logger.error("%s; failing %d in-flight request(s)", reason, len(self.streams))
        streams, self.streams = list(self.streams.values()), {}
        for s in streams:
            s.fail(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)
