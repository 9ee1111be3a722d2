"""The front end's half of a move: where each request runs, which run of it speaks for it, and the
outputs a move's destination sent before the move was done.

One table, used by every front end there is: the server's engine client
(tandem/engine/core_client.py), the cluster simulator (tandem/sim/simulator.py) and the engine
tests' cluster harness (tests/kvtransfer/cluster_harness.py). It does no I/O: its callers send
the messages and feed it what comes back.

- **Routes.** Exactly one instance runs a request's computation at a time (`where`).
- **Incarnations.** Every send of a request (its Add, a resume elsewhere, a move's destination
  run) is a new run, numbered per request and never reused, even by a move that failed (`route`,
  `start_move`). Engines echo the run in each `SampleOutput`; only the run the table follows
  (`runs`) speaks for the request, so what a run it has left sent before it was aborted is
  dropped, and no token comes twice, even when a request moves back to an instance it ran on.
- **Held outputs.** During a move the source stays the owner until its `Migrated` says the
  destination took over; whatever the destination's run sends before that is held with the move
  and released, in order, once the move completed (`sort`, `complete`).

    event                                             table
    ------------------------------------------------  -------------------------------------------
    route(rid, i)                  (Add, resume)      where = i, follows a new run
    start_move(rid, src, dst)      (MigrateOut)       a move under way, its destination run issued
    sort(i, output)                (Outputs)          deliver if from the followed run on `where`;
                                                      hold if from the move's destination run;
                                                      else drop (stale)
    outcome(i, Migrated)                              ends the move it answers (from its source)
    complete(move)                 (COMPLETED)        where = destination, follows its run, the
                                                      held outputs come back to be delivered
    dropped(i, TransferDropped)                       ends the move it answers (from its destination)
    give_up(rid)                   (never sent; its   the move taken off, no outcome awaited
                                   source is gone)
    forget(rid)                    (finished, lost)   nothing left of it
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tandem.core.engine_io import EngineCoreRequest, SampleOutput
from tandem.kvtransfer.protocol import Migrated, MigrateOut, TransferDropped


@dataclass(slots=True)
class LiveMove:
    """A move the front end has asked for and not yet heard the outcome of."""

    source: int
    destination: int
    incarnation: int  # the destination's run of the request
    transfer_id: str
    started: float
    after_prefill: bool = False  # a prefill/decode hand-off
    # The destination's outputs, held until the source's Migrated says it owns the request.
    held: list[SampleOutput] = field(default_factory=list)
    # When the request's stream last got an output from the source (what a completed move's
    # downtime runs from).
    last_delivered: float = 0.0


@dataclass(frozen=True, slots=True)
class MovableRequest:
    """A request a front end could move now (it runs on an instance, no move under way), as the
    migration policy sees it (tandem/cluster/migrator.py)."""

    request_id: str
    instance: int
    priority: int
    started: bool  # has produced output (its KV is worth moving live)
    seq: int  # order of first routing; larger is more recent
    seats: int = 1  # sequence seats it takes (its samples, n)


class Routes:
    def __init__(self) -> None:
        # request id -> the instance that runs it now
        self.where: dict[str, int] = {}
        # request id -> the run of it that speaks for it
        self.runs: dict[str, int] = {}
        # request id -> its move under way
        self.moves: dict[str, LiveMove] = {}
        # request id -> its order of first routing (the migration policy's "most recent")
        self.seqs: dict[str, int] = {}
        # request id -> the last run handed out (never reused, even by a move that failed)
        self._issued: dict[str, int] = {}
        self._seq = 0

    def next_run(self, request_id: str) -> int:
        """The run the request's next send (`route`) will be."""
        return self._issued.get(request_id, -1) + 1

    def route(self, request_id: str, instance: int) -> int:
        """The request runs on `instance` as a new run, which the table follows; returns the run."""
        run = self.next_run(request_id)
        self._issued[request_id] = run
        self.runs[request_id] = run
        self.where[request_id] = instance
        if request_id not in self.seqs:
            self._seq += 1
            self.seqs[request_id] = self._seq
        return run

    def start_move(
        self, request_id: str, source: int, destination: int, now: float, after_prefill: bool = False
    ) -> LiveMove:
        """A move of the request from `source` to `destination`, as its next run."""
        run = max(1, self.next_run(request_id))
        self._issued[request_id] = run
        move = LiveMove(
            source, destination, run, f"{request_id}@{run}", now, after_prefill, last_delivered=now
        )
        self.moves[request_id] = move
        return move

    def sort(self, instance: int, so: SampleOutput) -> bool:
        """True if `so` (from `instance`) speaks for its request now; a move's destination run's
        output is held with the move; anything else is stale and dropped (False both ways)."""
        rid = so.request_id
        if self.where.get(rid) == instance and self.runs.get(rid) == so.incarnation:
            return True
        move = self.moves.get(rid)
        if move is not None and move.destination == instance and move.incarnation == so.incarnation:
            move.held.append(so)
        return False

    def outcome(self, instance: int, msg: Migrated) -> LiveMove | None:
        """The move `msg` (from `instance`) ends, taken off the table; None if it answers none
        (a move given up meanwhile, or another source)."""
        move = self.moves.get(msg.request_id)
        if move is None or move.transfer_id != msg.transfer_id or move.source != instance:
            return None
        del self.moves[msg.request_id]
        return move

    def dropped(self, instance: int, msg: TransferDropped) -> LiveMove | None:
        """The move a destination's `TransferDropped` ends, taken off the table; None if none."""
        move = self.moves.get(msg.request_id)
        if move is None or move.transfer_id != msg.transfer_id or move.destination != instance:
            return None
        del self.moves[msg.request_id]
        return move

    def give_up(self, request_id: str) -> LiveMove | None:
        """Take the request's move off the table with no outcome to wait for (it never reached its
        source, or its source is gone)."""
        return self.moves.pop(request_id, None)

    def complete(self, request_id: str, move: LiveMove) -> list[SampleOutput]:
        """The destination runs the request now: it is routed there, its run followed; returns the
        outputs held meanwhile, to deliver in order."""
        self.where[request_id] = move.destination
        self.runs[request_id] = move.incarnation
        held, move.held = move.held, []
        return held

    def forget(self, request_id: str) -> tuple[int | None, LiveMove | None]:
        """The request ended: it is taken off the table. Returns the instance it ran on and its
        move under way (whose destination may hold a copy of it)."""
        self.runs.pop(request_id, None)
        self._issued.pop(request_id, None)
        self.seqs.pop(request_id, None)
        return self.where.pop(request_id, None), self.moves.pop(request_id, None)

    def on(self, instance: int) -> list[str]:
        """The requests routed to `instance`."""
        return [rid for rid, i in self.where.items() if i == instance]

    def touches(self, instance: int) -> bool:
        """Whether a request runs on `instance` or a move goes from or to it."""
        return instance in self.where.values() or any(
            mv.source == instance or mv.destination == instance for mv in self.moves.values()
        )


def migrate_out(req: EngineCoreRequest, move: LiveMove, peer: str) -> MigrateOut:
    """The message that tells a move's source to hand `req` over to `peer` (the destination's KV
    inbox) as the move's run."""
    return MigrateOut(replace(req, incarnation=move.incarnation), move.transfer_id, peer, move.after_prefill)
