"""Moves as the server's front end runs them: live migrations and prefill/decode hand-offs
(tandem/kvtransfer/protocol.py for the whole protocol, tandem/kvtransfer/routes.py for the route
table's part), and what each move is reported as (`MoveReport`, for the metrics).

`start` sends `MigrateOut` to the source; the source's `Migrated` (`outcome`) ends the move: a
completed one routes the request to its destination and releases the outputs held meanwhile; a
request with nothing computed (`RECOMPUTED`) moves by recompute; a refused or abandoned one goes
on at its source (a failed hand-off is computed on the decode side instead). A destination that
gave a silent source's transfer up (`TransferDropped`) gets the request by recompute. A completed
move is reported once its destination's first output reached the stream: its downtime, as the
stream saw it, runs from the source's last output to that one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from tandem.core.engine_io import SampleOutput
from tandem.engine import messages as m
from tandem.engine.instances import Instances
from tandem.engine.placement import decode_target
from tandem.engine.routing import Router
from tandem.kvtransfer.protocol import MoveOutcome, MoveReport
from tandem.kvtransfer.routes import LiveMove, migrate_out

logger = logging.getLogger("tandem.client")


class MoveHost(Protocol):
    """What moves need of the rest of the front end."""

    def deliver(self, instance: int, updates: list[SampleOutput]) -> None: ...

    def migrate_by_recompute(self, request_id: str, instance: int) -> bool: ...

    def resume_or_lose(self, request_id: str, reason: str) -> None: ...

    def stopped_samples(self, request_id: str) -> list[int]: ...


class Moves:
    def __init__(
        self, router: Router, instances: Instances, host: MoveHost, clock: Callable[[], float]
    ) -> None:
        self.router = router
        self.instances = instances
        self.host = host
        # What moves are timed with (a test's own clock in its place).
        self.clock = clock
        # Told each move's outcome (metrics); a completed one's once the destination's first output
        # reached its stream (its downtime is known then).
        self.on_migrated: Callable[[MoveReport], None] | None = None
        # request id -> a completed move whose destination has not delivered an output yet, and when
        # the stream got its last output from the source
        self.landing: dict[str, tuple[MoveReport, float]] = {}
        self.num_started = 0  # live migrations and prefill/decode hand-offs
        self.num_completed = 0
        self.num_aborted = 0
        # Live migrations their destination refused up front (no free seat, no room): nothing copied.
        self.num_refused = 0
        self.num_pd_fallbacks = 0

    @property
    def under_way(self) -> dict[str, LiveMove]:
        return self.router.table.moves

    def start(self, request_id: str, source: int, destination: int, after_prefill: bool = False) -> None:
        """Tell `source` to hand the request to `destination`, KV and all, as its next run
        (ValueError if the destination takes no transfers or the message cannot be encoded,
        EngineDeadError if the source cannot be reached; nothing is recorded then)."""
        peer = self.instances.kv_addresses[destination]
        if peer is None:
            raise ValueError(f"engine instance {destination} takes no KV transfers")
        table = self.router.table
        req = self.router.requests[request_id]
        # Sent before it is recorded: a move that never reached its source leaves nothing behind
        # (its run number is used up all the same).
        move = table.start_move(request_id, source, destination, self.clock(), after_prefill)
        try:
            self.instances.send(source, self.instances.encode(migrate_out(req, move, peer)))
        except BaseException:
            table.give_up(request_id)
            raise
        self.num_started += 1

    def outcome(self, instance: int, msg: m.Migrated) -> None:
        """A move's outcome, from its source (after its last outputs of the request)."""
        move = self.router.table.outcome(instance, msg)
        if move is None:
            return
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
        self.instances.tell(move.destination, m.Abort([rid]))  # a copy it may have installed
        if msg.outcome is MoveOutcome.RECOMPUTED:
            self.host.migrate_by_recompute(rid, move.destination)
        else:
            refused = msg.outcome is MoveOutcome.REFUSED
            if refused:
                self.num_refused += 1
            else:
                self.num_aborted += 1
            logger.info(
                "live migration of %s to instance %d %s: %s",
                rid,
                move.destination,
                "refused there" if refused else "abandoned",
                msg.reason,
            )
            if move.after_prefill:  # the hand-off failed: the decode side computes it all
                self.num_pd_fallbacks += 1
                inst = self.instances
                target = decode_target(
                    move.destination, self.router.disaggregation, inst.dispatchable, inst.live
                )
                self.host.migrate_by_recompute(rid, target)
        self.report(report)

    def _completed(self, source: int, move: LiveMove, report: MoveReport) -> None:
        """The destination runs the request now: route it there and release its held outputs."""
        rid = report.request_id
        self.num_completed += 1
        held = self.router.moved(rid, move)
        if move.destination not in self.instances.live:  # it died after taking the request over
            self.instances.tell(source, m.Abort([rid]))
            self.report(report)
            self.host.resume_or_lose(rid, f"engine instance {move.destination} died")
            return
        earlier = self.landing.pop(rid, None)  # moved on before its previous move landed
        if earlier is not None:
            self.report(earlier[0])
        self.landing[rid] = (report, move.last_delivered)
        self.host.deliver(move.destination, held)
        for i in self.host.stopped_samples(rid):  # a stop string the front end found meanwhile
            self.instances.tell(move.destination, m.StopSample(rid, i, "stop"))

    def dropped(self, instance: int, msg: m.TransferDropped) -> None:
        """A destination gave a transfer up (its source went silent): the request is moved there
        by recompute, its source told to drop it."""
        move = self.router.table.dropped(instance, msg)
        if move is None:
            return
        self.num_aborted += 1
        if move.after_prefill:
            self.num_pd_fallbacks += 1
        logger.warning("transfer of %s dropped by instance %d: %s", msg.request_id, instance, msg.reason)
        self.host.migrate_by_recompute(msg.request_id, instance)
        self.report(MoveReport(msg.request_id, MoveOutcome.DROPPED, move.after_prefill, reason=msg.reason))

    def instance_gone(self, instance: int) -> None:
        """Moves to a gone instance are cancelled at their source (which keeps the request, or,
        if it handed over already, says so and the request resumes from there); moves from it are
        dropped (the request resumes elsewhere) and the copy a destination may hold aborted."""
        for rid, move in list(self.under_way.items()):
            if move.destination == instance:
                self.instances.tell(move.source, m.MigrateCancel(rid, move.transfer_id))
            elif move.source == instance:
                self.router.table.give_up(rid)
                self.instances.tell(move.destination, m.Abort([rid]))
                self.num_aborted += 1

    def delivering(self, updates: list[SampleOutput]) -> None:
        """Outputs about to reach their streams: the last from a move's source, or the first from a
        completed move's destination (the move's downtime, as the stream sees it, ends here)."""
        if not (self.under_way or self.landing):
            return
        now = self.clock()
        for so in updates:
            move = self.under_way.get(so.request_id)
            if move is not None:
                move.last_delivered = now
            landing = self.landing.pop(so.request_id, None)
            if landing is not None:
                report, since = landing
                report.downtime_s = now - since
                self.report(report)

    def ended(self, request_id: str, move: LiveMove | None) -> None:
        """The request ended: its destination's possible copy goes; a move that landed with no
        output from the destination yet is reported without a downtime."""
        if move is not None:
            self.instances.tell(move.destination, m.Abort([request_id]))
        landing = self.landing.pop(request_id, None)
        if landing is not None:
            self.report(landing[0])

    def report(self, report: MoveReport) -> None:
        if self.on_migrated is not None:
            self.on_migrated(report)
