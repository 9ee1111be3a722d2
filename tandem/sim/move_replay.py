"""A run's moves replayed as its step trace recorded them (tandem/engine/step_trace.py's move lines).

Which request moves, from where to where and when, is the migration policy's choice, made on the
server's own timers over load reports the engines send on theirs: a replay driven by step
durations cannot make it again, so it takes each move from the record (`RecordedMove`). Each act
of a move happens at its recorded moment: the front end starts it when it decided it; the source
begins it, and, where it recorded a stage or the pause, its sender looks at the request again;
the destination reserves room when it accepted the move and installs the request when it did;
the source drops its copy when it saw the install, and the front end routes the request to its
destination when the outcome reached it. The plane acts between an engine's steps, and a replay
whose steps keep the recorded times places each act between the same two steps.

What the simulator decides itself is what a replay checks: at each of the sender's looks, the
protocol (tandem/kvtransfer/protocol.py: a stage of the full blocks filled since the last, while
more than `migration_stop_blocks` were and fewer than `migration_max_stages` went, else the
pause with the rest), from the request's state in the simulation. Each act the simulator did is
set against the recorded one (`ActDone.alike`: same kind, after the same step, same blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.core.request import Request, RequestStatus
from tandem.kvtransfer.protocol import MoveOutcome
from tandem.sim.replay import MoveAct, RecordedMove

if TYPE_CHECKING:
    from tandem.sim.simulator import ClusterSim, Transfer


@dataclass(frozen=True, slots=True)
class ActDone:
    """What the simulator did where the run did `recorded` ("none": nothing, its request was not
    there or not running)."""

    move: int  # the index of its RecordedMove
    kind: str
    step: int  # the instance's working steps before it
    blocks: int | None
    recorded: MoveAct

    @property
    def alike(self) -> bool:
        r = self.recorded
        return (
            self.kind == r.kind
            and self.step == r.step
            and (self.blocks is None or r.blocks is None or self.blocks == r.blocks)
        )


@dataclass(slots=True)
class _Replaying:
    move: RecordedMove
    request_id: str
    transfer: Transfer | None = None
    source_req: Request | None = None  # the run on the source
    reserved: list[int] = field(default_factory=list)  # the destination's blocks for it
    seats: int = 0
    installed: bool = False


class MoveReplay:
    """The recorded moves of one replay; `ClusterSim` hands it its events."""

    def __init__(self, sim: ClusterSim, moves: list[RecordedMove]) -> None:
        self.sim = sim
        self.moves = [_Replaying(m, f"r{m.index}") for m in moves]
        # Per instance: its acts in the order they happened, each released once the instance has
        # run the steps the run had before it.
        self._acts: list[list[tuple[int, float, int, MoveAct]]] = [[] for _ in sim.instances]
        for i, m in enumerate(moves):
            for act in m.acts:
                self._acts[act.instance].append((act.step, act.at_s, i, act))
        for acts in self._acts:
            acts.sort(key=lambda a: (a[0], a[1]))
        self._next = [0] * len(sim.instances)
        self.done: list[ActDone] = []

    def front_events(self) -> list[tuple[float, bool, int]]:
        """The front end's events to schedule: (when, landed (else decided), move)."""
        events = [(r.move.decided_s, False, i) for i, r in enumerate(self.moves)]
        events += [(r.move.landed_s, True, i) for i, r in enumerate(self.moves) if r.move.landed_s is not None]
        return events

    def due(self, instance: int) -> list[tuple[float, int, MoveAct]]:
        """The acts of `instance` that come after the steps it has run: (when, move, act)."""
        steps = self.sim.instances[instance].num_steps
        acts, out = self._acts[instance], []
        while self._next[instance] < len(acts) and acts[self._next[instance]][0] <= steps:
            _, at, i, act = acts[self._next[instance]]
            out.append((max(self.sim.clock[0], at), i, act))
            self._next[instance] += 1
        return out

    # -- the front end --------------------------------------------------------------------

    def decided(self, i: int) -> None:
        sim, r = self.sim, self.moves[i]
        if r.transfer is not None or r.request_id not in sim.requests:
            return
        from tandem.sim.simulator import Transfer

        m = r.move
        move = sim.table.start_move(r.request_id, m.source, m.destination, sim.clock[0])
        r.transfer = Transfer(r.request_id, move, started=True)
        sim.transfers[r.request_id] = r.transfer

    def landed(self, i: int) -> None:
        sim, r = self.sim, self.moves[i]
        rid = r.request_id
        if r.transfer is None:
            return  # it never started here
        completed = r.move.outcome == MoveOutcome.COMPLETED.value and r.installed
        if completed:
            sim.migrations += 1
            sim.records[r.move.index].num_moves += 1
        elif r.source_req is not None:
            sim.migrations_aborted += 1
        if rid not in sim.core_reqs:
            return  # it ended meanwhile (on its destination, if it got there)
        move = r.transfer.move
        sim._outcome(rid, move, MoveOutcome.COMPLETED if completed else MoveOutcome.ABORTED)
        if completed:
            sim.table.complete(rid, move)
            sim.dispatcher.routed(sim.core_reqs[rid], move.destination)

    # -- the engines ----------------------------------------------------------------------

    def act(self, i: int, act: MoveAct) -> None:
        sim, r = self.sim, self.moves[i]
        inst = sim.instances[act.instance]
        req = sim.requests.get(r.request_id)
        kind: str = act.kind
        blocks: int | None = None
        bs = sim.spec.block_size
        if kind == "begin":
            self.decided(i)  # (a run without the API process's lines)
            if req is None or r.transfer is None or req not in inst.scheduler.running:
                kind = "none"
            else:
                r.source_req = req
                blocks = -(-req.num_computed_tokens // bs) + 1
        elif kind == "accept":
            r.reserved = inst.kv.take_blocks(act.blocks or 0) or []
            inst.scheduler.reserved_seats += 1
            r.seats = 1
        elif kind in ("stage", "pause"):
            t = r.transfer
            if t is None or r.source_req is None or req is not r.source_req or req not in inst.scheduler.running:
                kind = "none"
            else:
                kind, blocks = self._look(t, req, act.instance)
        elif kind == "install":
            if r.source_req is None or req is not r.source_req:
                kind = "none"
            else:
                blocks = self._install(r, act.instance)
        elif kind == "end":
            self._end(r, act)
        self.done.append(ActDone(i, kind, inst.num_steps, blocks, act))

    def _look(self, t: Transfer, req: Request, source: int) -> tuple[str, int]:
        """The sender's look after a step (tandem/kvtransfer/sender.py `_advance`): a stage or the pause."""
        from tandem.sim.simulator import MIGRATION_MAX_STAGES, MIGRATION_STOP_BLOCKS

        bs = self.sim.spec.block_size
        new = req.num_computed_tokens // bs - t.sent
        if new > MIGRATION_STOP_BLOCKS and t.stages < MIGRATION_MAX_STAGES:
            t.sent += new
            t.stages += 1
            return "stage", new
        self.sim.instances[source].scheduler.pause(req)
        return "pause", -(-req.num_computed_tokens // bs) - t.sent

    def _install(self, r: _Replaying, destination: int) -> int:
        """As the receiver installs a handed-over request: its blocks from the reservation."""
        sim, src_req = self.sim, r.source_req
        assert src_req is not None
        source = sim.instances[r.move.source].scheduler
        if src_req in source.running:  # the simulation never paused it: pause it now
            source.pause(src_req)
        dst = sim.instances[destination]
        need = -(-src_req.num_computed_tokens // sim.spec.block_size)
        if len(r.reserved) < need:
            r.reserved += dst.kv.take_blocks(need - len(r.reserved)) or []
        moved = sim._request(sim.core_reqs[r.request_id], src_req.output_token_ids)
        moved.num_computed_tokens = src_req.num_computed_tokens
        moved.first_scheduled_time = src_req.first_scheduled_time
        moved.first_token_time = src_req.first_token_time
        moved.num_preemptions = src_req.num_preemptions
        dst.kv.give(moved, r.reserved[:need], add_reference=True)
        dst.kv.drop(r.reserved)
        r.reserved = []
        dst.scheduler.reserved_seats -= r.seats
        r.seats = 0
        dst.scheduler.adopt(moved)
        sim.requests[r.request_id] = moved
        r.installed = True
        sim._kick(dst)
        return need

    def _end(self, r: _Replaying, act: MoveAct) -> None:
        """The source ends its copy (the destination runs it), or gives the move up."""
        sim, src_req = self.sim, r.source_req
        src = sim.instances[r.move.source]
        if src_req is None:
            return
        if act.outcome == MoveOutcome.COMPLETED.value and sim.requests.get(r.request_id) is not src_req:
            src.scheduler.finish_requests([src_req.request_id], RequestStatus.FINISHED_ABORTED)
        else:
            if src_req.status == RequestStatus.PAUSED:
                src.scheduler.unpause(src_req)
            dst = sim.instances[r.move.destination]
            dst.kv.drop(r.reserved)
            dst.scheduler.reserved_seats -= r.seats
            r.reserved, r.seats = [], 0
        sim._kick(src)


def move_fidelity(done: list[ActDone], recorded: int) -> dict[str, int]:
    """Counts of the acts replayed: recorded, done alike, and the stages and pauses of each side."""
    return {
        "move_acts": recorded,
        "move_acts_alike": sum(d.alike for d in done),
        "stages_run": sum(d.recorded.kind == "stage" for d in done),
        "stages_replay": sum(d.kind == "stage" for d in done),
        "pauses_run": sum(d.recorded.kind == "pause" for d in done),
        "pauses_replay": sum(d.kind == "pause" for d in done),
    }
