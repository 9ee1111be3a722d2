"""An EngineCore driven by messages from a front end: the engine side of the process boundary.

`serve_engine` runs the loop wherever it is hosted: `run_engine_core` is the entry point of the
engine process `tandem serve` spawns; another host (a Ray actor, say) calls `serve_engine` with its
own addresses (tcp:// across machines) and its own liveness check.

The loop never waits on the front end: it drains what has arrived without blocking, runs a step
while there is work, and only when idle blocks on its input socket (with a timeout, so it also
notices when its host says stop). Outputs go out unbounded (no high-water mark), so a slow reader
cannot stall the engine.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from tandem.config import EngineConfig
from tandem.engine import messages as m
from tandem.engine.load_report import STATS_INTERVAL_S, LoadReport
from tandem.kvtransfer.plane import KVPlane, inbox_address
from tandem.kvtransfer.protocol import MoveOutcome

logger = logging.getLogger("tandem.engine")

IDLE_POLL_MS = 200
# Idle but a KV transfer is under way: wake this often to advance it and check its timeouts.
TRANSFER_POLL_MS = 5
# An idle engine still reports this often: the front end takes a long silence for a hung engine.
HEARTBEAT_S = 1.0


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Process entry point (multiprocessing spawn target): serve until the parent goes away."""
    # Ctrl-C reaches the whole process group: the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(message)s")
    code = serve_engine(config, in_addr, out_addr, lambda: os.getppid() == parent_pid)
    sys.exit(code)


def serve_engine(config: EngineConfig, in_addr: str, out_addr: str, alive: Callable[[], bool]) -> int:
    """Connect to a front end's two sockets, build the core, and run the loop while `alive()`.

    Returns 0 after a Shutdown or once `alive()` is false, 1 after reporting a fatal error."""
    import zmq

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(out_addr)
    code = 0
    loop: EngineLoop | None = None
    try:
        loop = EngineLoop(config, inp, out, alive, kv_bind=inbox_address(in_addr))
        loop.run()
    except Exception as exc:  # report, then stop: the front end fails the requests in flight
        logger.error("engine core failed:\n%s", traceback.format_exc())
        out.send(m.encoder().encode(m.Failed(f"{type(exc).__name__}: {exc}")))
        code = 1
    finally:
        if loop is not None and loop.kv is not None:
            loop.kv.close()
        inp.close(linger=0)
        out.close()
        ctx.term()
    return code


class EngineLoop:
    def __init__(
        self,
        config: EngineConfig,
        inp: Any,
        out: Any,
        alive: Callable[[], bool],
        kv_bind: str | None = None,
    ) -> None:
        import zmq

        self.inp, self.out = inp, out
        self.alive = alive
        self.core: Any = None
        self.kv: KVPlane | None = None
        self.enc = m.encoder()
        self.dec = m.engine_decoder()
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.stopping = False
        self.dirty = True
        # Set by an abort: the next snapshot goes out after the coming step, not on the timer, so
        # freed blocks show in metrics within a step of the abort.
        self.stats_due = False
        self.last_stats = 0.0
        self.load = LoadReport()
        self._send(m.Hello(os.getpid()))
        # Import torch and the model code while the front end loads the tokenizer (whose EOS id
        # the core needs, so the core itself is built once Init arrives).
        import tandem.worker.model_runner  # noqa: F401

        init = None
        while init is None:
            msg = self._recv(IDLE_POLL_MS)
            if isinstance(msg, m.Init):
                init = msg
            elif isinstance(msg, m.Shutdown) or not self.alive():
                self.stopping = True  # told to stop before the core was built: run() returns at once
                return
        from tandem.engine.core import EngineCore

        core = EngineCore(config, tuple(init.extra_eos_token_ids))
        self.core = core
        # What start-up built (the model, tables, caches) lives as long as this process: frozen out
        # of the collector's reach, a full collection scans only what serving makes
        # (docs/defaults.md: the step-loop pauses it saves).
        gc.collect()
        gc.freeze()
        if kv_bind is not None:
            log = None if core.step_trace is None else core.step_trace.move
            self.kv = KVPlane.open(core, config, kv_bind, self._send, log=log)  # core is its KVHost
            self.poller.register(self.kv.socket, zmq.POLLIN)
        kv_address = None if self.kv is None else self.kv.address
        self._send(m.Ready(os.getpid(), self.core.limits, self.core.kv.cache is not None, kv_address))
        logger.info(
            "engine core ready: %d KV blocks of %d tokens (%d tokens, KV cache %s)",
            self.core.num_blocks,
            config.block_size,
            self.core.num_blocks * config.block_size,
            self.core.runner.kv_format.name,
        )

    def _send(self, msg: object) -> None:
        self.out.send(self.enc.encode(msg), copy=False)

    def _recv(self, timeout_ms: int) -> object | None:
        """The next message from the front end; KV transfer messages met meanwhile are handled."""
        import zmq

        ready = dict(self.poller.poll(timeout_ms))
        if self.kv is not None and ready.get(self.kv.socket):
            self.kv.handle()
            self.dirty = True
        if not ready.get(self.inp):
            return None
        try:
            return self.dec.decode(self.inp.recv(flags=zmq.NOBLOCK, copy=False).buffer)
        except zmq.Again:
            return None

    def run(self) -> None:
        core = self.core
        steps = 0
        while not self.stopping:
            busy = core.has_unfinished_requests()
            transferring = self.kv is not None and self.kv.active
            self._drain(0 if busy else TRANSFER_POLL_MS if transferring else IDLE_POLL_MS)
            if self.stopping:
                break
            if self.kv is not None and self.kv.tick():
                self.dirty = True
            if core.has_unfinished_requests():
                outputs = core.step()
                steps += 1
                self.dirty = True
                finished = any(o.finish_reason is not None for o in outputs)
                now = time.monotonic()
                due = finished or self.stats_due or now - self.last_stats >= STATS_INTERVAL_S
                stats = self._stats() if due else None
                if outputs or stats is not None:
                    self._send(m.Outputs(outputs, stats))
                if self.kv is not None:
                    # Only here, after a step: a live migration's next stage or its pause always has
                    # a step of the request's decoding between it and the previous stage.
                    self.kv.after_step()
                if steps % 256 == 0 and not self.alive():
                    break
            else:
                if self.dirty or time.monotonic() - self.last_stats >= HEARTBEAT_S:
                    self._send(m.Outputs([], self._stats()))
                if not self.alive():
                    break

    def _drain(self, timeout_ms: int) -> None:
        msg = self._recv(timeout_ms)
        while msg is not None:
            self._handle(msg)
            msg = self._recv(0)

    def _handle(self, msg: object) -> None:
        core = self.core
        self.dirty = True
        if isinstance(msg, m.Add):
            try:
                core.add_request(msg.request)
            except ValueError as exc:
                self._send(m.Rejected(msg.request.request_id, str(exc)))
        elif isinstance(msg, m.Abort):
            core.abort_requests(msg.request_ids)
            if self.kv is not None:
                for rid in msg.request_ids:
                    self.kv.receiver.drop_request(rid)
            self.stats_due = True
        elif isinstance(msg, m.StopSample):
            core.stop_sample(msg.request_id, msg.index, msg.reason)
        elif isinstance(msg, m.MigrateOut):
            if self.kv is None:
                rid = msg.request.request_id
                self._send(m.Migrated(rid, msg.transfer_id, MoveOutcome.ABORTED, "no KV transport"))
            else:
                self.kv.sender.start(msg)
        elif isinstance(msg, m.MigrateCancel):
            if self.kv is not None:
                self.kv.sender.cancel(msg.transfer_id)
        elif isinstance(msg, m.Shutdown):
            self.stopping = True

    def _stats(self) -> m.Stats:
        core = self.core
        self.dirty = False
        self.stats_due = False
        self.last_stats = time.monotonic()
        load = self.load.fields(core.scheduler, core.kv, self.last_stats)
        if self.load.prefix_pending:
            self.dirty = True  # changed but not reported yet: a later snapshot carries it
        return m.Stats(**load, counters=core.counters.take())
