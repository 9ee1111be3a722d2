"""The cluster simulator: a discrete-event loop over simulated instances and the real global code.

Time advances from event to event (an arrival, the end of an instance's step, a load report, a
migration round, the end of a KV transfer). The cluster's global parts are the server's, composed
by the same `build_cluster` (tandem/cluster/build.py): requests are placed by the front end's own
placement (tandem/engine/placement.py: the real `Dispatcher`, prefill/decode roles) over load
reports built by the engines' own builder (tandem/engine/load_report.py, every
`REPORT_INTERVAL_S`); running requests move in the real `Migrator`'s rounds, for which the
simulator is the front end (`MoveFront`), or, replaying a served run, as the run recorded them
(tandem/sim/move_replay.py); with prefill/decode roles, a request prefilled on a
prefill instance moves to the least loaded decode instance at its first token. Where each request
runs, which run of it is followed and the moves under way are kept in the front end's own route
table (tandem/kvtransfer/routes.py), and each request is built as the engine builds it
(`core.engine_io.sample_request`). A move takes the cost model's
transfer time for the request's blocks: a live migration copies them in stages as the engine's
sender does (tandem/kvtransfer/protocol.py), the request decoding on its source meanwhile, each
stage the full blocks filled since the last, until no more than `migration_stop_blocks` were
filled during one or `migration_max_stages` went (the engine's defaults); then it pauses the
request for the transfer of the rest; a hand-off's blocks streamed during the prefill, so only the
last one is on the critical path.

The front end and the engine loop take the cost model's times, measured on a served engine: the
front end takes a request in as it arrives (refusing it past `max_waiting_requests`, placing it)
and its engine has it `ingress_seconds` later (the API process, the message to the engine); a token
reaches its client `delivery_seconds` after the step that made it (the output message, the SSE
chunk, the HTTP hop, the client's read) when the front end is idle; with the cost model's front-end
CPU figures the steps' output messages queue for the front end one at a time and a token waits for
the tokens before it (`tandem.sim.frontend`). After each step the engine loop spends
`loop_gap_seconds` before planning the next. Instances
that share a host (`instances_per_host`: CPU instances on one machine) run their steps slower while
others run theirs (`tandem.sim.host`); the front end then runs on the first host, and its ingress
and delivery times stretch as a step would with that host's active instances.

Simplifications, stated: requests ignore EOS (they run to their output length) and sample a fixed
token; n = 1; a move whose destination has no free seat or blocks is abandoned (the request stays,
a hand-off's too: the server would recompute it on the decode side); moves are live (migration
mode "recompute" is not modelled); a request that is not running when its move would start
(waiting, preempted) is not moved.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.cluster.build import build_cluster
from tandem.cluster.config import ClusterConfig
from tandem.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig
from tandem.core.engine_io import EngineCoreRequest, sample_request
from tandem.core.request import Request, RequestStatus
from tandem.engine.load_report import STATS_INTERVAL_S, LoadReport
from tandem.engine.messages import Stats
from tandem.engine.placement import place
from tandem.kvtransfer.protocol import Migrated, MoveOutcome
from tandem.kvtransfer.routes import LiveMove, MovableRequest, Routes
from tandem.sampling_params import SamplingParams
from tandem.sim.cost import CostModel
from tandem.sim.frontend import FrontEnd
from tandem.sim.host import Host
from tandem.sim.instance import InstanceSpec, SimInstance
from tandem.sim.move_replay import MoveReplay
from tandem.sim.replay import RecordedTimes
from tandem.sim.trace import Trace

# As the engine loop reports (tandem/engine/core_proc.py).
REPORT_INTERVAL_S = STATS_INTERVAL_S
# KV usage is sampled this often for the report's timeline.
USAGE_SAMPLE_S = 1.0

ARRIVAL, STEP, REPORT, REBALANCE, MOVED, SAMPLE, PLAN, ADMIT, RELEASE, MOVE_ACT, MOVE_FRONT = range(11)


@dataclass(slots=True)
class RequestRecord:
    """What a client would have seen of one request."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_s: float | None = None
    instance: int = -1
    num_moves: int = 0


@dataclass(slots=True)
class Transfer:
    """A move's copy as its source's sender runs it (the front end's half is the route table's
    `LiveMove`)."""

    request_id: str
    move: LiveMove
    sent: int = 0  # full blocks copied by the stages so far
    stages: int = 0
    started: bool = False  # a hand-off's copy starts at the first token


def _engine_default(name: str) -> int:
    value = next(f.default for f in fields(EngineConfig) if f.name == name)
    assert isinstance(value, int)
    return value


# A live migration's staging, as the engines run it by default.
MIGRATION_MAX_STAGES = _engine_default("migration_max_stages")
MIGRATION_STOP_BLOCKS = _engine_default("migration_stop_blocks")


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    num_instances: int
    preemptions: int
    migrations: int
    migrations_aborted: int
    handoffs: int
    usage_timeline: list[tuple[float, list[float]]]
    busy_fraction: list[float]
    steps: int
    refused: int = 0  # by the front end's bound on waiting requests


class ClusterSim:
    def __init__(
        self,
        trace: Trace,
        cost: CostModel,
        spec: InstanceSpec,
        cluster: ClusterConfig,
        vocab_size: int = 32000,
        progress: Callable[[float], None] | None = None,
        record_steps: bool = False,
        instances_per_host: int = 1,
        max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
        instance_costs: list[CostModel] | None = None,
        recorded: RecordedTimes | None = None,
    ) -> None:
        """`max_waiting_requests`: the front end's bound on accepted requests with no token yet,
        past which it refuses new ones (the server's `--max-waiting-requests`); None: unbounded.
        `instance_costs`: each instance's own step-time model (a replay of a real run's steps,
        tandem/sim/replay.py); by default `cost` for all. `recorded`: a replayed run's own way in of
        each request, first step of each instance and (optionally) the moments its front end saw
        each request end, in place of the cost model's ingress and of releasing at the step's end."""
        self.trace = trace
        self.cost = cost
        self.spec = spec
        self.cluster = cluster
        self.vocab_size = vocab_size
        self.recorded = recorded
        self.progress = progress
        self.clock = [0.0]
        n = cluster.num_instances
        costs = instance_costs if instance_costs is not None else [cost] * n
        if len(costs) != n:
            raise ValueError(f"instance_costs has {len(costs)} models for {n} instances")
        self.instances = [SimInstance(i, spec, costs[i], self.clock, record_steps) for i in range(n)]
        if instances_per_host < 1:
            raise ValueError(f"instances_per_host must be at least 1, got {instances_per_host}")
        # Hosts only where instances share one and the cost model says sharing costs something.
        shared = instances_per_host > 1 and cost.co_run_slowdown(2) > 1.0
        self.host_of: list[Host | None] = [None] * n
        if shared:
            for first in range(0, n, instances_per_host):
                host = Host(cost.co_run_slowdown)
                for i in range(first, min(n, first + instances_per_host)):
                    self.host_of[i] = host
        # The instances whose host the front end shares (none unless hosts are shared).
        self._front_end_host = [i for i in range(n) if shared and self.host_of[i] is self.host_of[0]]
        self.front_end = FrontEnd(cost)
        # Bumped whenever an instance's step end moves (a host's load changed): older events are stale.
        self._step_version = [0] * n
        self.parts = build_cluster(cluster, self, [spec.num_blocks] * n, spec.block_size)
        self.dispatcher = self.parts.dispatcher
        self.rebalancer = self.parts.migrator.rebalancer
        self.live = set(range(n))
        # The front end's view (tandem/cluster/migrator.py: MoveFront): no instance drains here.
        self.dead: str | None = None
        self.draining: set[int] = set()
        self.disaggregation = self.parts.roles
        self.table = Routes()
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.records: list[RequestRecord] = []
        self.requests: dict[str, Request] = {}
        self.core_reqs: dict[str, EngineCoreRequest] = {}
        self.transfers: dict[str, Transfer] = {}
        self.migrations = self.migrations_aborted = self.handoffs = 0
        self.max_waiting_requests = max_waiting_requests
        self.not_started = 0  # accepted requests whose first token is not out yet
        self.refused = 0
        self.usage_timeline: list[tuple[float, list[float]]] = []
        with_prefixes = cluster.dispatch_policy == "prefix_aware"
        self._load = [LoadReport(with_prefixes) for _ in range(n)]
        self._seqs: dict[str, int] = {}
        # A replayed run's moves, as recorded, in place of the migration policy's rounds.
        self.move_replay = (
            MoveReplay(self, recorded.moves) if recorded is not None and recorded.moves is not None else None
        )

    # -- the loop -----------------------------------------------------------------------

    def _at(self, t: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        for i, r in enumerate(self.trace.requests):
            self._at(r.arrival_s, ARRIVAL, i)
        self._at(0.0, REPORT)
        self._at(0.0, SAMPLE)
        if self.move_replay is not None:
            for t, landed, i in self.move_replay.front_events():
                self._at(t, MOVE_FRONT, (landed, i))
            for inst in self.instances:  # acts before an instance's first step
                first = None if self.recorded is None else self.recorded.first_step_s[inst.index]
                self._due_acts(inst.index, first)
        elif self.cluster.migration_triggers:
            self._at(self.cluster.migration_interval_s, REBALANCE)
        if self.recorded is not None:  # no step before the recorded first one (the replay's clock)
            for inst, first in zip(self.instances, self.recorded.first_step_s):
                inst.in_loop_gap = True
                self._at(first, PLAN, inst.index)
        remaining = len(self.trace.requests)
        done = 0
        next_progress = 0.0
        while self._events and done < remaining:
            t, _, kind, payload = heapq.heappop(self._events)
            self.clock[0] = t
            if kind == ARRIVAL:
                done += self._arrive(payload)
            elif kind == STEP:
                index, version = payload
                if version == self._step_version[index]:
                    done += self._step_done(index)
            elif kind == ADMIT:
                done += self._admit(*payload)
            elif kind == PLAN:
                inst = self.instances[payload]
                inst.in_loop_gap = False
                self._kick(inst)
            elif kind == REPORT:
                self._report()
                self._at(t + REPORT_INTERVAL_S, REPORT)
            elif kind == REBALANCE:
                self._rebalance()
                self._at(t + self.cluster.migration_interval_s, REBALANCE)
            elif kind == MOVED:
                self._moved(payload)
            elif kind == RELEASE:
                self.dispatcher.release(payload)
            elif kind == MOVE_ACT:
                assert self.move_replay is not None
                self.move_replay.act(*payload)
            elif kind == MOVE_FRONT:
                assert self.move_replay is not None
                landed, i = payload
                if landed:
                    self.move_replay.landed(i)
                else:
                    self.move_replay.decided(i)
            elif kind == SAMPLE:
                self.usage_timeline.append((t, [inst.kv_usage for inst in self.instances]))
                self._at(t + USAGE_SAMPLE_S, SAMPLE)
            if self.progress is not None and t >= next_progress:
                self.progress(t)
                next_progress = t + 10.0
        duration = self.clock[0]
        return SimResult(
            records=self.records,
            duration_s=duration,
            num_instances=len(self.instances),
            preemptions=sum(inst.scheduler.counters.num_preemptions for inst in self.instances),
            migrations=self.migrations,
            migrations_aborted=self.migrations_aborted,
            handoffs=self.handoffs,
            usage_timeline=self.usage_timeline,
            busy_fraction=[inst.busy_s / duration if duration else 0.0 for inst in self.instances],
            steps=sum(inst.num_steps for inst in self.instances),
            refused=self.refused,
        )

    def _kick(self, inst: SimInstance) -> None:
        """Start the instance's next step if it is idle and has work."""
        if inst.busy:
            return
        seconds = inst.start_step()
        if seconds is None:
            return
        host = self.host_of[inst.index]
        if host is None:
            self._end_step_at(inst.index, self.clock[0] + seconds)
            return
        for i, end in host.start(inst.index, seconds, self.clock[0]).items():
            self._end_step_at(i, end)

    def _end_step_at(self, index: int, t: float) -> None:
        self._step_version[index] += 1
        self._at(t, STEP, (index, self._step_version[index]))

    # -- arrivals and dispatch --------------------------------------------------------------

    def _arrive(self, index: int) -> int:
        """Dispatch a new request; 1 if it was refused (it is then over), else 0."""
        tr = self.trace.requests[index]
        rid = f"r{index}"
        prompt = self.trace.prompt_token_ids(index, self.vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=tr.output_len, ignore_eos=True)
        core_req = EngineCoreRequest(rid, prompt, params, tr.output_len, tr.arrival_s, tr.priority, tr.tenant)
        record = RequestRecord(index, tr.arrival_s, tr.prompt_len, tr.output_len)
        self.records.append(record)
        if self.max_waiting_requests is not None and self.not_started + 1 > self.max_waiting_requests:
            self.refused += 1  # the front end's 503 "overloaded": over at once, counted as failed
            return 1
        instance, handoff = self._place(core_req)
        self.dispatcher.routed(core_req, instance)
        self.not_started += 1
        record.instance = instance
        self._seqs[rid] = index
        if self.recorded is not None:
            ingress = self.recorded.ingress_s[index]
        else:
            ingress = self.cost.ingress_seconds() * self._front_end_slowdown()
        self._at(self.clock[0] + ingress, ADMIT, (core_req, instance, handoff))
        return 0

    def _admit(self, core_req: EngineCoreRequest, instance: int, handoff: int | None) -> int:
        """The request reaches its engine; 1 if it can never run there (it is then over), else 0."""
        rid = core_req.request_id
        req = self._request(core_req)
        try:
            self.instances[instance].add(req)
        except ValueError:  # can never run (too long for the instances): counted as failed
            self.records[self._seqs.pop(rid)].finish_s = None
            self.dispatcher.release(rid)
            self.not_started -= 1
            return 1
        self.requests[rid] = req
        self.core_reqs[rid] = core_req
        self.table.route(rid, instance)
        if handoff is not None:  # the front end asks for the hand-off with the request
            move = self.table.start_move(rid, instance, handoff, self.clock[0], after_prefill=True)
            self.transfers[rid] = Transfer(rid, move)
        self._kick(self.instances[instance])
        return 0

    def _front_end_slowdown(self) -> float:
        """How much longer the front end's work takes now: on a shared host, as a step would with
        the host's active instances (1 on a host of its own)."""
        if not self._front_end_host:
            return 1.0
        active = sum(1 for i in self._front_end_host if self.instances[i].has_work)
        return self.cost.co_run_slowdown(max(1, active))

    def _place(self, req: EngineCoreRequest) -> tuple[int, int | None]:
        """As the front end places a request (tandem/engine/placement.py)."""
        return place(req, self.dispatcher, self.disaggregation, self.live - self.draining, self.live)

    @staticmethod
    def _request(req: EngineCoreRequest, outputs: list[int] | None = None) -> Request:
        return sample_request(req, 0, outputs)

    # -- steps ------------------------------------------------------------------------------

    def _step_done(self, index: int) -> int:
        inst = self.instances[index]
        now = self.clock[0]
        host = self.host_of[index]
        if host is not None:
            for i, end in host.finish(index, now).items():
                self._end_step_at(i, end)
        done = [(req, self.records[self._seqs[req.request_id]]) for req in inst.finish_step()]
        news = [req.num_output_tokens - len(record.token_times) for req, record in done]
        # The step's output message through the front end: when the client has each new token.
        seen = self.front_end.deliver(now, sum(news), self._front_end_slowdown())
        finished = 0
        at = 0
        for (req, record), new in zip(done, news):
            record.token_times.extend(seen[at : at + new])
            at += new
            if record.first_token_s is None and record.token_times:
                record.first_token_s = record.token_times[0]
                self.not_started -= 1
            if req.is_finished:
                record.finish_s = seen[at - 1] if new > 0 else now + self.cost.delivery_seconds()
                finished += 1
                self._forget(req.request_id)
            elif req.num_output_tokens >= 1:
                transfer = self.transfers.get(req.request_id)
                if transfer is not None and transfer.move.after_prefill and not transfer.started:
                    self._hand_over(transfer)
        gap = inst.cost.loop_gap_seconds()
        self._due_acts(index, now + gap)  # before the next plan: the plane acts between steps
        if gap > 0:  # the loop sends outputs and takes in requests before it plans again
            inst.in_loop_gap = True
            self._at(now + gap, PLAN, index)
        else:
            self._kick(inst)
        return finished

    def _due_acts(self, index: int, plan_at: float | None) -> None:
        """A replayed move's acts on this instance that come after the steps it has run, each at
        its recorded time but before the instance plans again (at `plan_at`): the trace's times
        are rounded, and the plane acted before the engine's next step."""
        if self.move_replay is not None:
            for t, i, act in self.move_replay.due(index):
                at = t if plan_at is None else min(t, plan_at)
                if at <= self.clock[0]:  # now: before this instance plans (a loop with no gap)
                    self.move_replay.act(i, act)
                else:
                    self._at(at, MOVE_ACT, (i, act))

    def _forget(self, rid: str) -> None:
        released = None if self.recorded is None or self.recorded.release_s is None else (
            self.recorded.release_s[self._seqs[rid]]
        )
        if released is not None and released > self.clock[0]:
            self._at(released, RELEASE, rid)  # the front end had not seen the end yet
        else:
            self.dispatcher.release(rid)
        self.table.forget(rid)
        self.requests.pop(rid, None)
        self.core_reqs.pop(rid, None)
        self.transfers.pop(rid, None)

    # -- reports ----------------------------------------------------------------------------

    def _report(self) -> None:
        now = self.clock[0]
        for inst in self.instances:
            load = self._load[inst.index].fields(inst.scheduler, inst.kv, now)
            self.dispatcher.observe(inst.index, Stats(**load))

    # -- moving requests --------------------------------------------------------------------

    def _rebalance(self) -> None:
        self.parts.migrator.round()

    # The front end's view the migration policy reads (tandem/cluster/migrator.py: MoveFront).

    @property
    def moves(self) -> dict[str, LiveMove]:
        return self.table.moves

    def movable(self) -> list[MovableRequest]:
        seqs = self.table.seqs
        return [
            MovableRequest(
                rid,
                instance,
                self.requests[rid].priority,
                self.requests[rid].num_output_tokens > 0,
                seqs[rid],
            )
            for rid, instance in self.table.where.items()
            if rid not in self.table.moves
        ]

    def incoming(self) -> dict[int, int]:
        seats: dict[int, int] = {}
        for move in self.table.moves.values():
            seats[move.destination] = seats.get(move.destination, 0) + 1
        return seats

    def move(self, request_id: str, instance: int, live: bool) -> bool:
        """A live migration's first stage (moves are live here, whatever `live` says); False if
        the request is not running (waiting, preempted) or is there already."""
        source = self.table.where[request_id]
        req = self.requests[request_id]
        if req.status != RequestStatus.RUNNING or source == instance:
            return False
        transfer = Transfer(request_id, self.table.start_move(request_id, source, instance, self.clock[0]))
        self.transfers[request_id] = transfer
        transfer.started = True
        self._stage_or_pause(transfer, req)
        return True

    def _hand_over(self, transfer: Transfer) -> None:
        """A hand-off's pause at the first token (its blocks streamed during the prefill: none
        left to copy but the last)."""
        transfer.started = True
        self._at(self.clock[0], MOVED, (transfer, "pause"))

    def _stage_or_pause(self, transfer: Transfer, req: Request) -> None:
        """As the engine's sender after a stage landed: another stage if enough blocks were filled
        meanwhile and stages are left, else the pause."""
        new = req.num_computed_tokens // self.spec.block_size - transfer.sent
        if new > MIGRATION_STOP_BLOCKS and transfer.stages < MIGRATION_MAX_STAGES:
            transfer.sent += new
            transfer.stages += 1
            self._at(self.clock[0] + self.cost.transfer_seconds(new), MOVED, (transfer, "stage"))
        else:
            self._at(self.clock[0], MOVED, (transfer, "pause"))

    def _outcome(self, rid: str, move: LiveMove, outcome: MoveOutcome) -> None:
        """The source's Migrated reaches the front end (at once: no message takes time here)."""
        ended = self.table.outcome(move.source, Migrated(rid, move.transfer_id, outcome))
        assert ended is move, (rid, outcome)
        self.transfers.pop(rid, None)

    def _moved(self, payload: tuple[Transfer, str]) -> None:
        transfer, phase = payload
        move, rid = transfer.move, transfer.request_id
        if self.transfers.get(rid) is not transfer:
            return  # the request finished meanwhile
        req = self.requests[rid]
        src = self.instances[move.source]
        if req.status != RequestStatus.RUNNING and phase != "install":  # preempted meanwhile: given up
            self._outcome(rid, move, MoveOutcome.ABORTED)
            self.migrations_aborted += 1
            return
        if phase == "stage":
            self._stage_or_pause(transfer, req)
        elif phase == "pause":
            src.scheduler.pause(req)
            bs = self.spec.block_size
            last = -(-req.num_computed_tokens // bs) - (0 if move.after_prefill else transfer.sent)
            self._at(self.clock[0] + self.cost.transfer_seconds(max(1, last)), MOVED, (transfer, "install"))
        else:
            self._install(move, rid, req)

    def _install(self, move: LiveMove, rid: str, req: Request) -> None:
        src, dst = self.instances[move.source], self.instances[move.destination]
        bs = self.spec.block_size
        need = -(-req.num_computed_tokens // bs)
        core = self.core_reqs[rid]
        blocks = dst.kv.take_blocks(need) if dst.scheduler.seats_taken + 1 <= dst.spec.max_num_seqs else None
        if blocks is None:
            self._outcome(rid, move, MoveOutcome.REFUSED)
            src.scheduler.unpause(req)  # no room there: it goes on here
            self.migrations_aborted += 1
            self._kick(src)
            return
        self._outcome(rid, move, MoveOutcome.COMPLETED)
        moved = self._request(core, req.output_token_ids)
        moved.num_computed_tokens = req.num_computed_tokens
        dst.kv.give(moved, blocks, add_reference=False)
        moved.first_scheduled_time = req.first_scheduled_time
        moved.first_token_time = req.first_token_time
        moved.num_preemptions = req.num_preemptions
        src.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
        dst.scheduler.adopt(moved)
        self.requests[rid] = moved
        self.table.complete(rid, move)  # nothing is held: the destination has run no step of it yet
        self.records[self._seqs[rid]].num_moves += 1
        self.dispatcher.routed(core, move.destination)
        if move.after_prefill:
            self.handoffs += 1
        else:
            self.migrations += 1
        self._kick(src)
        self._kick(dst)
