"""The front end's side of one engine instance: how messages get there and back, and whether it lives.

An `EngineConnection` carries encoded messages to one engine loop (`core_proc.serve_engine`) and
back over a ZeroMQ PUSH/PULL pair that the front end binds; the host of the loop decides what
"alive" means. `ProcessConnection` hosts it in a spawned child process on `ipc://` paths (what
`tandem serve` runs); another host (a Ray actor on another machine) binds `tcp://` addresses and
answers `alive` from its own handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from typing import Any

from tandem.config import EngineConfig
from tandem.engine import messages as m

LIVENESS_POLL_MS = 200


class EngineDeadError(RuntimeError):
    """The engine instance has stopped; no request on it can make progress."""


class EngineConnection:
    """Two sockets to one engine loop. Subclasses start the loop's host and say if it lives."""

    name = "engine"

    def __init__(self) -> None:
        self._dec = m.client_decoder()
        # Seconds of silence after which a started engine counts as hung (None: never).
        self.hang_timeout_s: float | None = None
        self._last_heard = 0.0
        self._ctx: Any = None
        self._actx: Any = None
        self._in: Any = None
        self._out: Any = None

    def bind(self, in_addr: str, out_addr: str) -> None:
        self._sockets()
        self._in.bind(in_addr)
        self._out.bind(out_addr)

    def bind_tcp(self, host: str) -> tuple[str, str]:
        """Bind both sockets to free TCP ports on `host`; returns (in, out) addresses."""
        self._sockets()
        in_port = self._in.bind_to_random_port(f"tcp://{host}")
        out_port = self._out.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{in_port}", f"tcp://{host}:{out_port}"

    def _sockets(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._actx = zmq.asyncio.Context()
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)

    # -- what a host provides ------------------------------------------------------------

    def launch(self) -> None:
        """Start the engine loop's host (returns at once; `handshake` waits for it)."""
        raise NotImplementedError

    def exit_reason(self) -> str | None:
        """None while the host lives; once it has gone, why."""
        raise NotImplementedError

    async def stop_host(self, timeout: float) -> None:
        """Wait up to `timeout` for the host to end after a Shutdown, then make sure it has."""
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return None

    # -- messages --------------------------------------------------------------------------

    async def handshake(self, extra_eos_token_ids: list[int], timeout: float) -> m.Ready:
        """Hello from the loop, Init to it, Ready (with the core's limits) back."""
        await asyncio.wait_for(self._expect(m.Hello), timeout)
        init = m.encoder().encode(m.Init(extra_eos_token_ids))
        # Hello came back on the other socket: this one's connection may still be settling.
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                self.send(init)
                break
            except EngineDeadError:
                if self.exit_reason() is not None or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.01)
        return await asyncio.wait_for(self._expect(m.Ready), timeout)

    async def _expect(self, kind: type) -> Any:
        while True:
            msg = await self.recv()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, m.Failed):
                raise RuntimeError(f"the engine failed to start: {msg.message}")

    def send(self, payload: bytes) -> None:
        import zmq

        try:
            self._in.send(payload, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:  # no engine connected any more
            raise EngineDeadError(f"{self.name} is not reachable") from exc

    async def recv(self) -> Any:
        """The next message; EngineDeadError once the host has gone and nothing is left to read,
        or (with `hang_timeout_s` set, after the handshake) once it has said nothing for that long:
        a running engine reports at least every second, so a silent one is hung."""
        loop = asyncio.get_running_loop()
        while not await self._out.poll(LIVENESS_POLL_MS):
            reason = self.exit_reason()
            if reason is not None:
                raise EngineDeadError(reason)
            silent = loop.time() - self._last_heard
            if self.hang_timeout_s is not None and self._last_heard and silent > self.hang_timeout_s:
                raise EngineDeadError(f"{self.name} is hung: no word from it in {silent:.0f}s")
        msg = self._dec.decode(await self._out.recv(copy=False))
        if self._last_heard or isinstance(msg, m.Ready):
            self._last_heard = loop.time()
        return msg

    async def shutdown(self, timeout: float = 5.0) -> None:
        if self.exit_reason() is None:
            with contextlib.suppress(EngineDeadError):
                self.send(m.encoder().encode(m.Shutdown()))
            await self.stop_host(timeout)
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()


class ProcessConnection(EngineConnection):
    """The engine loop in a spawned child process, on `ipc://` paths in a fresh temporary folder."""

    name = "the engine process"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self._proc: Any = None
        self._tmp: str | None = None

    def launch(self) -> None:
        import multiprocessing

        from tandem.engine.core_proc import run_engine_core

        self._tmp = tempfile.mkdtemp(prefix="tandem-")
        in_addr, out_addr = f"ipc://{self._tmp}/in", f"ipc://{self._tmp}/out"
        self.bind(in_addr, out_addr)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.config, in_addr, out_addr, os.getpid()),
            name="tandem-engine-core",
            daemon=True,
        )
        self._proc.start()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def exit_reason(self) -> str | None:
        if self._proc is None or self._proc.is_alive():
            return None
        return f"the engine process exited (code {self._proc.exitcode})"

    async def stop_host(self, timeout: float) -> None:
        proc = self._proc
        if proc is not None and proc.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, proc.join, timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)

    async def shutdown(self, timeout: float = 5.0) -> None:
        await super().shutdown(timeout)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
