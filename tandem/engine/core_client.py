"""The front end of one or more engine instances: text in and out, one stream per request.

Text stays here: the client owns the tokenizer, the `InputProcessor` (validation against the
limits the core sends back at start-up) and the `OutputProcessor` (detokenization, stop strings,
logprobs). A stop string found here is sent to the core as `StopSample`.

`AsyncEngineClient` puts four managers together, one concern each:
- `Streams` (engine/streams.py): each request's mailbox to its caller;
- `Instances` (engine/instances.py): the engine instances, which live or drain, sending to them,
  their output loops (by default one instance, a spawned process: engine/connection.py);
- `Router` (engine/routing.py): where each request runs (placement: engine/placement.py; the
  route table: kvtransfer/routes.py) and each request as sent;
- `Moves` (engine/moves.py): live migrations and prefill/decode hand-offs under way.
What is left here is what crosses them: admission, outputs to streams, aborts, moving by
recompute, and an instance's death (its requests resume elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest, SampleOutput
from tandem.core.limits import EngineLimits
from tandem.engine import messages as m
from tandem.engine.connection import EngineConnection, EngineDeadError, ProcessConnection
from tandem.engine.front_trace import FrontEndTrace
from tandem.engine.instances import Instances
from tandem.engine.moves import Moves
from tandem.engine.placement import Disaggregation, DispatchHook
from tandem.engine.processor import InputProcessor, OutputProcessor
from tandem.engine.routing import Router
from tandem.engine.streams import RequestAbortedError, RequestFailedError, RequestStream, Streams
from tandem.engine.tokenizer import Tokenizer
from tandem.kvtransfer.protocol import MoveReport
from tandem.kvtransfer.routes import LiveMove, MovableRequest
from tandem.outputs import RequestOutput

__all__ = [
    "AsyncEngineClient",
    "Disaggregation",
    "EngineDeadError",
    "LiveMove",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestStream",
]

logger = logging.getLogger("tandem.client")


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
        self.make_dispatcher = make_dispatcher
        # What moves are timed with (a test's own clock in its place).
        self.clock: Callable[[], float] = time.monotonic
        self.streams = Streams()
        self.instances = Instances(
            connections if connections is not None else [ProcessConnection(config)], hang_timeout_s
        )
        self.router = Router(self.instances, disaggregation)
        self.migrations = Moves(self.router, self.instances, self, lambda: self.clock())
        self.migrations.on_migrated = on_migrated
        self.num_resumed = 0
        self.num_migrated = 0  # moved by recompute
        self.dead: str | None = None
        self.limits: EngineLimits | None = None
        self.tokenizer: Tokenizer | None = None
        self.inputs: InputProcessor | None = None
        self.outputs: OutputProcessor | None = None
        # The front end's share of a step trace: when each request was placed and released.
        traced = None if config is None else config.step_trace
        self.front_trace = FrontEndTrace(traced) if traced else None

    @property
    def _outputs(self) -> OutputProcessor:
        """The output processor, which `start` makes: no request reaches it before then."""
        if self.outputs is None:
            raise RuntimeError("the engine client is not started")
        return self.outputs

    # What the server's metrics, the cluster's policy and the tests read, by the names they use.

    @property
    def connections(self) -> list[EngineConnection]:
        return self.instances.connections

    @property
    def engine_pid(self) -> int | None:
        return self.connections[0].pid

    @property
    def dispatcher(self) -> DispatchHook | None:
        return self.router.dispatcher

    @dispatcher.setter
    def dispatcher(self, dispatcher: DispatchHook | None) -> None:
        self.router.dispatcher = dispatcher

    @property
    def disaggregation(self) -> Disaggregation | None:
        return self.router.disaggregation

    @property
    def routes(self) -> dict[str, int]:
        """request id -> the instance that runs it now"""
        return self.router.table.where

    @property
    def requests(self) -> dict[str, EngineCoreRequest]:
        return self.router.requests

    @property
    def moves(self) -> dict[str, LiveMove]:
        """request id -> its move under way"""
        return self.router.table.moves

    @property
    def live(self) -> set[int]:
        return set(self.instances.live)

    @property
    def draining(self) -> set[int]:
        return self.instances.draining

    @property
    def dispatchable(self) -> set[int]:
        """Live instances that take new requests (not draining)."""
        return self.instances.dispatchable

    @property
    def num_moves_started(self) -> int:
        return self.migrations.num_started

    @property
    def num_live_migrations(self) -> int:
        return self.migrations.num_completed

    @property
    def num_live_aborted(self) -> int:
        return self.migrations.num_aborted

    @property
    def num_live_refused(self) -> int:
        return self.migrations.num_refused

    @property
    def num_pd_fallbacks(self) -> int:
        return self.migrations.num_pd_fallbacks

    # -- lifecycle ---------------------------------------------------------

    async def start(self, timeout: float = 600.0) -> None:
        """Start every instance's host, load the tokenizer meanwhile, and wait for the cores' limits."""
        self.instances.launch()
        loop = asyncio.get_running_loop()
        tok_path = self.config.tokenizer or self.config.model
        self.tokenizer = await loop.run_in_executor(None, Tokenizer, tok_path)
        eos = self.tokenizer.eos_token_id
        readies = await self.instances.handshake([] if eos is None else [eos], timeout)
        # Instances of one model share its limits but for their caches: validate against the smallest.
        self.limits = min((r.limits for r in readies), key=lambda lim: lim.num_blocks)
        self.inputs = InputProcessor(
            self.tokenizer, self.limits, self.config.structured_outputs_check_timeout_s
        )
        self.outputs = OutputProcessor(self.tokenizer)
        if self.make_dispatcher is not None:
            self.router.dispatcher = self.make_dispatcher(readies)
        self.instances.listen(self._handle, self._instance_died)

    async def shutdown(self, timeout: float = 5.0) -> None:
        if self.inputs is not None:
            self.inputs.close()
        await self.instances.shutdown(timeout)

    # -- requests ------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self.streams)

    @property
    def num_waiting(self) -> int:
        """Accepted requests with no output yet, as this process sees them."""
        return self.streams.num_waiting

    def add(
        self,
        req: EngineCoreRequest,
        prompt_text: str | None,
        notify: asyncio.Event,
        on_finish: Callable[[RequestOutput], None] | None = None,
        instance: int | None = None,
    ) -> RequestStream:
        """Queue a request validated by `self.inputs.process` on an instance (by default the
        placement's choice, or the first); outputs arrive on the returned stream."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        handoff = None
        if instance is None:
            instance, handoff = self.router.place(req)
            if self.front_trace is not None:
                self.front_trace.event("placed", req.request_id, time.monotonic())
        if instance not in self.instances.live:
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
                self.router.send(req, instance)
            except EngineDeadError as exc:
                if self.router.dispatcher is None or len(self.instances.live) < 2:
                    raise
                # The instance died before its output loop noticed. Giving it up now resumes its
                # requests elsewhere, this one (routed already) among them, or fails them if none
                # can run: either way the stream says what became of it.
                self._instance_died(instance, str(exc))
                return stream
            if handoff is not None:
                self.migrations.start(req.request_id, instance, handoff, after_prefill=True)
        except BaseException:
            self.streams.pop(req.request_id, None)
            self._unroute(req.request_id)
            self._outputs.abort([req.request_id])
            raise
        return stream

    async def retire(self, instance: int, timeout: float = 5.0) -> None:
        """Shut a drained instance down (scale in); it must hold no request."""
        if self.router.table.touches(instance):
            raise RuntimeError(f"engine instance {instance} still runs requests")
        self.router.instance_gone(instance)
        if self.on_gone is not None:
            self.on_gone(instance)
        await self.instances.retire(instance, timeout)

    def _unroute(self, request_id: str) -> int | None:
        """Forget where a request runs (it ended); returns the instance it ran on."""
        instance, move = self.router.forget(request_id)
        if self.front_trace is not None:
            self.front_trace.event("released", request_id, time.monotonic())
        self.migrations.ended(request_id, move)
        return instance

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
            self.instances.tell(instance, m.Abort(group))

    def abort_all(self, reason: str) -> None:
        """End every in-flight request with RequestAbortedError (server shutdown)."""
        streams = list(self.streams.values())
        self.abort(list(self.streams))
        for s in streams:
            s.fail(RequestAbortedError(reason))

    # -- outputs -------------------------------------------------------------

    def _handle(self, instance: int, msg: Any) -> None:
        if isinstance(msg, m.Outputs):
            if msg.stats is not None:
                if self.router.dispatcher is not None:
                    self.router.dispatcher.observe(instance, msg.stats)
                if self.on_stats is not None:
                    self.on_stats(instance, msg.stats)
            # Only the run of a request the client follows speaks for it (kvtransfer/routes.py).
            table = self.router.table
            self.deliver(instance, [so for so in msg.outputs if table.sort(instance, so)])
        elif isinstance(msg, m.Migrated):
            if self.front_trace is not None:
                self.front_trace.move("landed", msg.request_id, time.monotonic(), outcome=msg.outcome.value)
            self.migrations.outcome(instance, msg)
        elif isinstance(msg, m.TransferDropped):
            self.migrations.dropped(instance, msg)
        elif isinstance(msg, m.Rejected):
            stream = self.streams.pop(msg.request_id, None)
            self._unroute(msg.request_id)
            self._outputs.abort([msg.request_id])
            if stream is not None:
                stream.fail(ValueError(msg.message))
        elif isinstance(msg, m.Failed):
            raise EngineDeadError(f"the engine failed: {msg.message}")

    def deliver(self, instance: int, updates: list[SampleOutput]) -> None:
        """Outputs of the runs the client follows, from `instance`, to their streams."""
        if not updates:
            return
        self.migrations.delivering(updates)
        outs, stops, failed = self._outputs.process(updates)
        for request_id, index, reason in stops:
            self.instances.tell(
                self.routes.get(request_id, instance), m.StopSample(request_id, index, reason)
            )
            move = self.moves.get(request_id)
            if move is not None:
                self.instances.tell(move.destination, m.StopSample(request_id, index, reason))
        if failed:
            self.instances.tell(instance, m.Abort(failed))
        for out in outs:
            if self.streams.deliver(out):
                self._unroute(out.request_id)

    def stopped_samples(self, request_id: str) -> list[int]:
        """The samples of a request the front end has seen finish (a stop string among them)."""
        group = self._outputs.groups.get(request_id)
        return [
            i for i, s in enumerate(group.samples if group is not None else []) if s.finish_reason is not None
        ]

    # -- moving requests ------------------------------------------------------------

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
            or instance not in self.instances.live
            or request_id in self.moves
        ):
            return False
        kv = self.instances.kv_addresses
        if kv[instance] is None or kv[source] is None:
            return self.migrate_by_recompute(request_id, instance)
        try:
            self.migrations.start(request_id, source, instance)
        except (EngineDeadError, ValueError):
            return False
        if self.front_trace is not None:
            self.front_trace.move("decided", request_id, time.monotonic(), source=source, destination=instance)
        return True

    def migrate_by_recompute(self, request_id: str, instance: int) -> bool:
        """Move a running request to another live instance: its source aborts it, the destination
        recomputes its KV from the tokens produced so far and goes on; its stream sees nothing.
        False (and nothing done) if it is not running or already there."""
        source = self.routes.get(request_id)
        if (
            source is None
            or source == instance
            or instance not in self.instances.live
            or request_id in self.moves
        ):
            return False
        self.instances.tell(source, m.Abort([request_id]))
        if self._resume(request_id, instance):
            self.num_migrated += 1
            return True
        # The destination could not take it: it goes on where it was, from where it had got to.
        if not self._resume(request_id, source):
            self._lose(request_id, EngineDeadError(f"request {request_id} could not be moved or kept"))
        return False

    def _resume(self, request_id: str, instance: int | None = None) -> bool:
        """Send a request again, to `instance` or a live one placement picks, with what each
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
                instance = self.router.resume_target(resumed)
            self.router.send(resumed, instance)
        except (EngineDeadError, ValueError):
            return False
        logger.info("request %s resumed on instance %d", request_id, instance)
        return True

    def resume_or_lose(self, request_id: str, reason: str) -> None:
        """Resume a request whose instance is gone elsewhere, or end it with `reason`."""
        if not (self.instances.live and self._resume(request_id)):
            self._lose(request_id, EngineDeadError(reason))

    def _lose(self, request_id: str, error: BaseException) -> None:
        """End a request the client can no longer run anywhere: its stream gets `error`."""
        self._unroute(request_id)
        self._outputs.abort([request_id])
        self.streams.fail(request_id, error)

    def _instance_died(self, instance: int, reason: str) -> None:
        """Resume the instance's requests on the others from the tokens they had produced (the
        client sees no error); with no instance left, fail them, and the client is dead."""
        self.instances.live.discard(instance)
        self.router.instance_gone(instance)
        if self.on_gone is not None:
            self.on_gone(instance)
        self.migrations.instance_gone(instance)
        lost = self.router.table.on(instance)
        logger.error("%s; %d request(s) in flight on it", reason, len(lost))
        for rid in lost:
            if self.instances.live and self._resume(rid):
                self.num_resumed += 1
                continue
            self._lose(rid, EngineDeadError(reason))
        if not self.instances.live and self.dead is None:
            self.dead = reason
            if self.on_dead is not None:
                self.on_dead(reason)

    # -- the migration policy's view (tandem/cluster/migrator.py: MoveFront) ---------------------

    def movable(self) -> list[MovableRequest]:
        """The requests running on an instance, with no move under way."""
        out = []
        for rid, instance in self.routes.items():
            req = self.requests.get(rid)
            stream = self.streams.get(rid)
            if req is None or stream is None or rid in self.moves:
                continue
            seq = self.router.table.seqs.get(rid, 0)
            out.append(MovableRequest(rid, instance, req.priority, stream.started, seq, req.params.n))
        return out

    def incoming(self) -> dict[int, int]:
        """Seats the moves under way will take at their destinations (reserved there once accepted)."""
        seats: dict[int, int] = {}
        for rid, mv in self.moves.items():
            moved = self.requests.get(rid)
            seats[mv.destination] = seats.get(mv.destination, 0) + (moved.params.n if moved else 1)
        return seats

    def move(self, request_id: str, instance: int, live: bool) -> bool:
        """Start moving a request (live, or by recompute); False if it cannot move now."""
        return (
            self.migrate_live(request_id, instance)
            if live
            else self.migrate_by_recompute(request_id, instance)
        )

    def runs_on(self, instance: int) -> bool:
        """Whether a request runs on `instance` or a move goes from or to it."""
        return self.router.table.touches(instance)
