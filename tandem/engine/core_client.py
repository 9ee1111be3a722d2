"""The front end of one or more engine instances: text in and out, one stream per request.

Text stays here: the client owns the tokenizer, the `InputProcessor` (validation against the
limits the core sends back at start-up) and the `OutputProcessor` (detokenization, stop strings,
logprobs). A stop string found here is sent to the core as `StopSample`. Each engine instance is
reached through an `EngineConnection` (engine/connection.py): by default one, a spawned process.

Each request's outputs reach its caller through a `RequestStream`: a mailbox holding the latest
cumulative `RequestOutput` (a newer one replaces an unread one, so a slow reader costs no memory),
or the delta outputs not read yet, joined when read (RequestOutputKind.DELTA), plus an
`asyncio.Event` that the caller waits on (one event may serve several streams).
A request is routed to one instance at a time; `move` hands it to another (its stream and text
state stay where they are: they belong to the front end, not to an instance).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tandem.config import EngineConfig
from tandem.core.limits import EngineLimits
from tandem.engine import messages as m
from tandem.engine.connection import EngineConnection, EngineDeadError, ProcessConnection
from tandem.engine.messages import EngineCoreRequest
from tandem.engine.processor import InputProcessor, OutputProcessor
from tandem.engine.tokenizer import Tokenizer
from tandem.kvtransfer.protocol import MoveOutcome, MoveReport
from tandem.outputs import RequestOutput, coalesce

__all__ = ["AsyncEngineClient", "EngineDeadError", "RequestAbortedError", "RequestFailedError", "RequestStream"]

logger = logging.getLogger("tandem.client")


class DispatchHook(Protocol):
    """What the client needs of a dispatcher across instances (tandem.cluster.dispatch.Dispatcher)."""

    num_dispatched: list[int]

    def choose(self, req: EngineCoreRequest, live: set[int]) -> int: ...

    def routed(self, req: EngineCoreRequest, instance: int) -> None: ...

    def release(self, request_id: str) -> None: ...

    def least_loaded(self, candidates: set[int]) -> int: ...

    def observe(self, instance: int, stats: m.Stats) -> None: ...

    def forget_instance(self, instance: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """Prefill/decode roles of the instances: a new request with at least `min_prompt_tokens`
    prompt tokens is prefilled on a prefill instance and handed to a decode instance at its first
    token; a shorter one runs wholly on a decode instance."""

    prefill: frozenset[int]
    decode: frozenset[int]
    min_prompt_tokens: int = 0


@dataclass(slots=True)
class LiveMove:
    """A live migration the client has asked for and not yet heard the outcome of."""

    source: int
    destination: int
    incarnation: int  # the destination's run of the request
    transfer_id: str
    started: float
    after_prefill: bool = False
    # The destination's outputs, held until the source's Migrated says it owns the request.
    held: list[m.SampleOutput] = field(default_factory=list)
    # When the request's stream last got an output from the source (what a completed move's
    # downtime runs from).
    last_delivered: float = 0.0


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


class AsyncEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: Callable[[int, m.Stats], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
        connections: list[EngineConnection] | None = None,
        make_dispatcher: Callable[[list[m.Ready]], DispatchHook] | None = None,
        on_migrated: Callable[[MoveReport], None] | None = None,
        disaggregation: Disaggregation | None = None,
        hang_timeout_s: float | None = None,
        on_gone: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.on_stats = on_stats
        # Told when an instance leaves for good (retired or dead), so its last report stops counting.
        self.on_gone = on_gone
        self.on_dead = on_dead
        # Told each move's outcome (metrics); a completed one's once the destination's first output
        # reached its stream (its downtime is known then).
        self.on_migrated = on_migrated
        self.disaggregation = disaggregation
        # An instance silent this long (after start-up) is taken for hung: its requests move on.
        self.hang_timeout_s = hang_timeout_s
        self.num_pd_fallbacks = 0
        self.connections = connections if connections is not None else [ProcessConnection(config)]
        self.make_dispatcher = make_dispatcher
        self.dispatcher: DispatchHook | None = None
        # request id -> the request as first sent (to resume it elsewhere if its instance dies)
        self.requests: dict[str, EngineCoreRequest] = {}
        # request id -> the incarnation (run) of it the client follows; outputs of others are stale
        self.incarnations: dict[str, int] = {}
        # request id -> the last incarnation handed out (never reused, even by a move that failed)
        self._issued: dict[str, int] = {}
        # request id -> its live migration under way
        self.moves: dict[str, LiveMove] = {}
        # request id -> a completed move whose destination has not delivered an output yet, and when
        # the stream got its last output from the source
        self._landing: dict[str, tuple[MoveReport, float]] = {}
        # What moves are timed with (a test's own clock in its place).
        self.clock: Callable[[], float] = time.monotonic
        # each instance's KV inbox (None: it takes no transfers)
        self.kv_addresses: list[str | None] = []
        self.num_resumed = 0
        self.num_migrated = 0
        self.num_moves_started = 0  # live migrations and prefill/decode hand-offs
        self.num_live_migrations = 0
        self.num_live_aborted = 0
        # Live migrations their destination refused up front (no free seat, no room): nothing copied.
        self.num_live_refused = 0
        self.dead: str | None = None
        self.limits: EngineLimits | None = None
        self.tokenizer: Tokenizer | None = None
        self.inputs: InputProcessor | None = None
        self.outputs: OutputProcessor | None = None
        self.streams: dict[str, RequestStream] = {}
        # request id -> index of the connection (instance) that runs it now
        self.routes: dict[str, int] = {}
        self._live: set[int] = set()
        # Instances being drained (scale in): live, but no new request goes there.
        self.draining: set[int] = set()
        # Instances shut down after a drain.
        self.retired: set[int] = set()
        # request id -> dispatch order (for the migration policy: most recent first)
        self.seqs: dict[str, int] = {}
        self._seq = 0
        self._enc = m.encoder()
        self._tasks: list[asyncio.Task] = []

    @property
    def _outputs(self) -> OutputProcessor:
        """The output processor, which `start` makes: no request reaches it before then."""
        if self.outputs is None:
            raise RuntimeError("the engine client is not started")
        return self.outputs

    @property
    def engine_pid(self) -> int | None:
        return self.connections[0].pid

    # -- lifecycle ---------------------------------------------------------

    async def start(self, timeout: float = 600.0) -> None:
        """Start every instance's host, load the tokenizer meanwhile, and wait for the cores' limits."""
        for conn in self.connections:
            conn.hang_timeout_s = self.hang_timeout_s
            conn.launch()
        loop = asyncio.get_running_loop()
        tok_path = self.config.tokenizer or self.config.model
        self.tokenizer = await loop.run_in_executor(None, Tokenizer, tok_path)
        eos = self.tokenizer.eos_token_id
        extra = [] if eos is None else [eos]
        readies = await asyncio.gather(*(c.handshake(extra, timeout) for c in self.connections))
        # Instances of one model share its limits but for their caches: validate against the smallest.
        self.limits = min((r.limits for r in readies), key=lambda lim: lim.num_blocks)
        self.kv_addresses = [r.kv_address for r in readies]
        self.inputs = InputProcessor(self.tokenizer, self.limits, self.config.structured_outputs_check_timeout_s)
        self.outputs = OutputProcessor(self.tokenizer)
        if self.make_dispatcher is not None:
            self.dispatcher = self.make_dispatcher(list(readies))
        self._live = set(range(len(self.connections)))
        self._tasks = [
            asyncio.create_task(self._output_loop(i), name=f"tandem-engine-outputs-{i}")
            for i in range(len(self.connections))
        ]

    async def shutdown(self, timeout: float = 5.0) -> None:
        if self.inputs is not None:
            self.inputs.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            *(c.shutdown(timeout) for i, c in enumerate(self.connections) if i not in self.retired),
            return_exceptions=True,
        )

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
        instance: int | None = None,
    ) -> RequestStream:
        """Queue a request validated by `self.inputs.process` on an instance (by default the
        dispatcher's choice, or the first); outputs arrive on the returned stream."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        handoff = None
        if instance is None:
            instance, handoff = self._place(req)
        if instance not in self._live:
            raise EngineDeadError(f"engine instance {instance} is not running")
        if req.request_id in self.streams:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        stream = RequestStream(req.request_id, notify, on_finish)
        # Registered and sent as one step: whatever fails in between (an unencodable field, a dead
        # engine) unregisters the request, so no error path leaves a stream behind.
        self.streams[req.request_id] = stream
        try:
            self._outputs.add(req, prompt_text)
            try:
                self._route(req, instance)
            except EngineDeadError as exc:
                if self.dispatcher is None or len(self._live) < 2:
                    raise
                # The instance died before its output loop noticed. Giving it up now resumes its
                # requests elsewhere, this one (routed already) among them, or fails them if none
                # can run: either way the stream says what became of it.
                self._instance_died(instance, str(exc))
                return stream
            if handoff is not None:
                self._start_move(req.request_id, instance, handoff, after_prefill=True)
        except BaseException:
            self.streams.pop(req.request_id, None)
            self._unroute(req.request_id)
            self._outputs.abort([req.request_id])
            raise
        return stream

    @property
    def live(self) -> set[int]:
        return set(self._live)

    @property
    def dispatchable(self) -> set[int]:
        """Live instances that take new requests (not draining)."""
        return self._live - self.draining

    async def retire(self, instance: int, timeout: float = 5.0) -> None:
        """Shut a drained instance down (scale in); it must hold no request."""
        if any(i == instance for i in self.routes.values()) or any(
            mv.source == instance or mv.destination == instance for mv in self.moves.values()
        ):
            raise RuntimeError(f"engine instance {instance} still runs requests")
        self.retired.add(instance)
        self._live.discard(instance)
        self.draining.discard(instance)
        if self.dispatcher is not None:
            self.dispatcher.forget_instance(instance)
        if self.on_gone is not None:
            self.on_gone(instance)
        task = self._tasks[instance]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.connections[instance].shutdown(timeout)

    def _place(self, req: EngineCoreRequest) -> tuple[int, int | None]:
        """Where a new request runs, and (prefill/decode) the decode instance it is handed to."""
        dispatcher = self.dispatcher
        if dispatcher is None:
            return 0, None
        pd = self.disaggregation
        if pd is None:
            return dispatcher.choose(req, self.dispatchable), None
        decode = self.dispatchable & set(pd.decode)
        prefill = self.dispatchable & set(pd.prefill)
        if not decode:  # no decode instance left: the prefill instances do everything
            return dispatcher.choose(req, prefill or self._live), None
        if not prefill or len(req.prompt_token_ids) < pd.min_prompt_tokens:
            return dispatcher.choose(req, decode), None
        return dispatcher.choose(req, prefill), dispatcher.least_loaded(decode)

    def _route(self, req: EngineCoreRequest, instance: int) -> None:
        """Send `req` to `instance`, as the request's next incarnation, and record that it runs there."""
        req = replace(req, incarnation=self._issued.get(req.request_id, -1) + 1)
        payload = self._encode(m.Add(req))
        self._issued[req.request_id] = req.incarnation
        self.incarnations[req.request_id] = req.incarnation
        self.routes[req.request_id] = instance
        if req.request_id not in self.seqs:
            self._seq += 1
            self.seqs[req.request_id] = self._seq
        self.requests[req.request_id] = req
        if self.dispatcher is not None:
            self.dispatcher.routed(req, instance)
        self.connections[instance].send(payload)

    def _unroute(self, request_id: str) -> int | None:
        """Forget where a request runs (it ended); returns the instance it ran on."""
        self.requests.pop(request_id, None)
        self.incarnations.pop(request_id, None)
        self._issued.pop(request_id, None)
        self.seqs.pop(request_id, None)
        move = self.moves.pop(request_id, None)
        if move is not None:  # its destination may hold a copy already
            self._send_to(move.destination, m.Abort([request_id]))
        landing = self._landing.pop(request_id, None)
        if landing is not None:  # it ended before the destination's first output
            self._report(landing[0])
        if self.dispatcher is not None:
            self.dispatcher.release(request_id)
        return self.routes.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if self.streams.pop(rid, None) is not None]
        if not ids:
            return
        self._outputs.abort(ids)
        by_instance: dict[int, list[str]] = {}
        for rid in ids:
            instance = self._unroute(rid)
            by_instance.setdefault(0 if instance is None else instance, []).append(rid)
        for instance, group in by_instance.items():
            self._send_to(instance, m.Abort(group))

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

    def _send_to(self, instance: int, msg: object) -> None:
        """A control message to an instance; dropped if the instance is gone (it holds nothing)."""
        if instance in self._live:
            with contextlib.suppress(EngineDeadError):
                self.connections[instance].send(self._encode(msg))

    # -- outputs -------------------------------------------------------------

    async def _output_loop(self, instance: int) -> None:
        try:
            while True:
                self._handle(instance, await self.connections[instance].recv())
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._instance_died(instance, str(exc))
            await self._put_down(instance)
        except Exception as exc:
            logger.exception("engine output loop failed")
            self._instance_died(instance, f"engine client error: {exc}")
            await self._put_down(instance)

    async def _put_down(self, instance: int) -> None:
        """Make sure an instance given up for dead (it may only be hung) stops."""
        conn = self.connections[instance]
        if conn.exit_reason() is None:
            with contextlib.suppress(Exception):
                await conn.stop_host(1.0)

    def _handle(self, instance: int, msg: Any) -> None:
        if isinstance(msg, m.Outputs):
            if msg.stats is not None:
                if self.dispatcher is not None:
                    self.dispatcher.observe(instance, msg.stats)
                if self.on_stats is not None:
                    self.on_stats(instance, msg.stats)
            # Only the run of a request the client follows speaks for it: what a run it has left
            # (the request moved, or resumed elsewhere, perhaps back to the same instance) sent
            # before it was aborted is dropped, so no token comes twice.
            updates = []
            for so in msg.outputs:
                if self.routes.get(so.request_id) == instance and self.incarnations.get(so.request_id) == so.incarnation:
                    updates.append(so)
                    continue
                move = self.moves.get(so.request_id)
                if move is not None and move.destination == instance and move.incarnation == so.incarnation:
                    move.held.append(so)
            self._deliver(instance, updates)
        elif isinstance(msg, m.Migrated):
            self._migrated(instance, msg)
        elif isinstance(msg, m.TransferDropped):
            self._dropped(instance, msg)
        elif isinstance(msg, m.Rejected):
            stream = self.streams.pop(msg.request_id, None)
            self._unroute(msg.request_id)
            self._outputs.abort([msg.request_id])
            if stream is not None:
                stream.fail(ValueError(msg.message))
        elif isinstance(msg, m.Failed):
            raise EngineDeadError(f"the engine failed: {msg.message}")

    def _deliver(self, instance: int, updates: list[m.SampleOutput]) -> None:
        """Outputs of the runs the client follows, from `instance`, to their streams."""
        if not updates:
            return
        if self.moves or self._landing:
            self._mark_moves(updates)
        outs, stops, failed = self._outputs.process(updates)
        for request_id, index, reason in stops:
            self._send_to(self.routes.get(request_id, instance), m.StopSample(request_id, index, reason))
            move = self.moves.get(request_id)
            if move is not None:
                self._send_to(move.destination, m.StopSample(request_id, index, reason))
        if failed:
            self._send_to(instance, m.Abort(failed))
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
                self._unroute(out.request_id)

    # -- live migration -----------------------------------------------------------

    def migrate_live(self, request_id: str, instance: int) -> bool:
        """Move a request to `instance` with its KV cache (tandem/kvtransfer/sender.py): it keeps
        running where it is while its blocks are copied, pauses for the last ones, and goes on
        there; its stream sees nothing. A request with nothing computed yet is moved by
        recompute instead. False (and nothing done) if it cannot be moved now."""
        source = self.routes.get(request_id)
        if (
            request_id not in self.requests
            or source is None
            or source == instance
            or instance not in self._live
            or request_id in self.moves
        ):
            return False
        if self.kv_addresses[instance] is None or self.kv_addresses[source] is None:
            return self.migrate_by_recompute(request_id, instance)
        try:
            self._start_move(request_id, source, instance)
        except (EngineDeadError, ValueError):
            return False
        return True

    def _start_move(self, request_id: str, source: int, instance: int, after_prefill: bool = False) -> None:
        """Tell `source` to hand the request to `instance`, KV and all, as its next incarnation."""
        peer = self.kv_addresses[instance]
        if peer is None:
            raise ValueError(f"engine instance {instance} takes no KV transfers")
        req = self.requests[request_id]
        run = self._issued.get(request_id, 0) + 1
        transfer_id = f"{request_id}@{run}"
        msg = self._encode(m.MigrateOut(replace(req, incarnation=run), transfer_id, peer, after_prefill))
        self.connections[source].send(msg)
        self._issued[request_id] = run
        now = self.clock()
        self.moves[request_id] = LiveMove(
            source, instance, run, transfer_id, now, after_prefill, last_delivered=now
        )
        self.num_moves_started += 1

    def _migrated(self, instance: int, msg: m.Migrated) -> None:
        """A move's outcome, from its source (after its last outputs of the request)."""
        move = self.moves.get(msg.request_id)
        if move is None or move.transfer_id != msg.transfer_id or move.source != instance:
            return
        del self.moves[msg.request_id]
        rid = msg.request_id
        report = MoveReport(
            rid,
            msg.outcome,
            move.after_prefill,
            msg.num_bytes,
            msg.num_stages,
            msg.transfer_s,
            msg.pause_s,
            reason=msg.reason,
        )
        if msg.outcome is MoveOutcome.COMPLETED:
            self._completed(instance, move, report)
            return
        self._send_to(move.destination, m.Abort([rid]))  # a copy it may have installed
        if msg.outcome is MoveOutcome.RECOMPUTED:
            self.migrate_by_recompute(rid, move.destination)
        else:
            refused = msg.outcome is MoveOutcome.REFUSED
            if refused:
                self.num_live_refused += 1
            else:
                self.num_live_aborted += 1
            logger.info(
                "live migration of %s to instance %d %s: %s",
                rid,
                move.destination,
                "refused there" if refused else "abandoned",
                msg.reason,
            )
            if move.after_prefill:  # the hand-off failed: the decode side computes it all
                self.num_pd_fallbacks += 1
                self.migrate_by_recompute(rid, self._decode_target(move.destination))
        self._report(report)

    def _completed(self, source: int, move: LiveMove, report: MoveReport) -> None:
        """The destination runs the request now: route it there and release its held outputs."""
        rid = report.request_id
        self.num_live_migrations += 1
        self.incarnations[rid] = move.incarnation
        self.routes[rid] = move.destination
        req = self.requests.get(rid)
        if req is not None:
            self.requests[rid] = replace(req, incarnation=move.incarnation)
            if self.dispatcher is not None:
                self.dispatcher.release(rid)
                self.dispatcher.routed(req, move.destination)
        if move.destination not in self._live:  # it died after taking the request over
            self._send_to(source, m.Abort([rid]))
            self._report(report)
            if not (self._live and self._resume(rid)):
                self._lose(rid, EngineDeadError(f"engine instance {move.destination} died"))
            return
        earlier = self._landing.pop(rid, None)  # moved on before its previous move landed
        if earlier is not None:
            self._report(earlier[0])
        self._landing[rid] = (report, move.last_delivered)
        self._deliver(move.destination, move.held)
        group = self._outputs.groups.get(rid)
        for i, sample in enumerate(group.samples if group is not None else []):
            if sample.finish_reason is not None:  # a stop string the front end found meanwhile
                self._send_to(move.destination, m.StopSample(rid, i, "stop"))

    def _mark_moves(self, updates: list[m.SampleOutput]) -> None:
        """Outputs about to reach their streams: the last from a move's source, or the first from a
        completed move's destination (the move's downtime, as the stream sees it, ends here)."""
        now = self.clock()
        for so in updates:
            move = self.moves.get(so.request_id)
            if move is not None:
                move.last_delivered = now
            landing = self._landing.pop(so.request_id, None)
            if landing is not None:
                report, since = landing
                report.downtime_s = now - since
                self._report(report)

    def _report(self, report: MoveReport) -> None:
        if self.on_migrated is not None:
            self.on_migrated(report)

    def _decode_target(self, preferred: int) -> int:
        """`preferred` if it lives, else another live decode instance (any live one without)."""
        if preferred in self._live:
            return preferred
        pd = self.disaggregation
        targets = (pd.decode & self.dispatchable if pd else set()) or self.dispatchable or self._live
        return min(targets) if targets else preferred

    def _dropped(self, instance: int, msg: m.TransferDropped) -> None:
        """A destination gave a transfer up (its source went silent): the request is moved there
        by recompute, its source told to drop it."""
        move = self.moves.get(msg.request_id)
        if move is None or move.transfer_id != msg.transfer_id or move.destination != instance:
            return
        del self.moves[msg.request_id]
        self.num_live_aborted += 1
        if move.after_prefill:
            self.num_pd_fallbacks += 1
        logger.warning("transfer of %s dropped by instance %d: %s", msg.request_id, instance, msg.reason)
        self.migrate_by_recompute(msg.request_id, instance)
        self._report(MoveReport(msg.request_id, MoveOutcome.DROPPED, move.after_prefill, reason=msg.reason))

    def _instance_died(self, instance: int, reason: str) -> None:
        """Resume the instance's requests on the others from the tokens they had produced (the
        client sees no error); with no instance left, fail them, and the client is dead."""
        self._live.discard(instance)
        if self.dispatcher is not None:
            self.dispatcher.forget_instance(instance)
        if self.on_gone is not None:
            self.on_gone(instance)
        for rid, move in list(self.moves.items()):
            if move.destination == instance:
                # The source keeps the request (or, if it handed over already, its Migrated says so
                # and the request is resumed from there).
                self._send_to(move.source, m.MigrateCancel(rid, move.transfer_id))
            elif move.source == instance:
                # The request is resumed below; a copy the destination may have installed must go.
                del self.moves[rid]
                self._send_to(move.destination, m.Abort([rid]))
                self.num_live_aborted += 1
        lost = [rid for rid, i in self.routes.items() if i == instance]
        logger.error("%s; %d request(s) in flight on it", reason, len(lost))
        for rid in lost:
            if self._live and self._resume(rid):
                self.num_resumed += 1
                continue
            self._lose(rid, EngineDeadError(reason))
        if not self._live and self.dead is None:
            self.dead = reason
            if self.on_dead is not None:
                self.on_dead(reason)

    def migrate_by_recompute(self, request_id: str, instance: int) -> bool:
        """Move a running request to another live instance: its source aborts it, the destination
        recomputes its KV from the tokens produced so far and goes on; its stream sees nothing.
        False (and nothing done) if it is not running or already there."""
        source = self.routes.get(request_id)
        if source is None or source == instance or instance not in self._live or request_id in self.moves:
            return False
        self._send_to(source, m.Abort([request_id]))
        if self._resume(request_id, instance):
            self.num_migrated += 1
            return True
        # The destination could not take it: it goes on where it was, from where it had got to.
        if not self._resume(request_id, source):
            self._lose(request_id, EngineDeadError(f"request {request_id} could not be moved or kept"))
        return False

    def _resume(self, request_id: str, instance: int | None = None) -> bool:
        """Send a request again, to `instance` or a live one the dispatcher picks, with what each
        sample has produced so far."""
        req = self.requests.get(request_id)
        group = self._outputs.groups.get(request_id)
        if req is None or group is None:
            return False
        done = [s.finish_reason is not None for s in group.samples]
        outputs = [None if d else list(s.token_ids) for s, d in zip(group.samples, done)]
        # Nothing produced yet: the request starts over as it came (its samples fork as usual).
        started = any(done) or any(outputs)
        resumed = replace(req, resumed_outputs=outputs if started else None)
        try:
            if instance is None:
                pd = self.disaggregation
                # Prefill/decode: resumed (recomputed) on a decode instance.
                targets = set(pd.decode & self.dispatchable if pd else ()) or self.dispatchable or self._live
                instance = self.dispatcher.choose(resumed, targets) if self.dispatcher else min(targets)
            self._route(resumed, instance)
        except (EngineDeadError, ValueError):
            return False
        logger.info("request %s resumed on instance %d", request_id, instance)
        return True

    def _lose(self, request_id: str, error: BaseException) -> None:
        """End a request the client can no longer run anywhere: its stream gets `error`."""
        self._unroute(request_id)
        stream = self.streams.pop(request_id, None)
        self._outputs.abort([request_id])
        if stream is not None:
            stream.fail(error)
