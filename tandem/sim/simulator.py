"""The cluster simulator: a discrete-event loop over simulated instances and the real global code.

Time advances from event to event (an arrival, the end of an instance's step, a load report, a
migration round, the end of a KV transfer). Requests are dispatched by the real `Dispatcher` over
load reports built as the engines build theirs (every `REPORT_INTERVAL_S`, prefix hashes at most
every `PREFIX_REPORT_INTERVAL_S`, as tandem/engine/core_proc.py does); running requests move by
the real `Rebalancer`'s plan; with prefill/decode roles, a request prefilled on a prefill instance
moves to the least loaded decode instance at its first token. A move takes the cost model's
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
token; n = 1; a move whose destination has no free seat or blocks is abandoned (the request stays).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.cluster.rebalance import Rebalancer, RequestView
from tandem.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig
from tandem.core.engine_io import EngineCoreRequest
from tandem.core.request import Request, RequestStatus
from tandem.engine.messages import Stats
from tandem.sampling_params import SamplingParams
from tandem.sim.cost import CostModel
from tandem.sim.frontend import FrontEnd
from tandem.sim.host import Host
from tandem.sim.instance import InstanceSpec, SimInstance
from tandem.sim.trace import Trace

# As the engine loop reports (tandem/engine/core_proc.py).
REPORT_INTERVAL_S = 0.2
PREFIX_REPORT_INTERVAL_S = 1.0
MAX_REPORTED_PREFIX_HASHES = 16384
# KV usage is sampled this often for the report's timeline.
USAGE_SAMPLE_S = 1.0

ARRIVAL, STEP, REPORT, REBALANCE, MOVED, SAMPLE, PLAN, ADMIT = range(8)


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
class Move:
    request_id: str
    source: int
    destination: int
    handoff: bool
    sent: int = 0  # full blocks copied by the stages so far
    stages: int = 0


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
    ) -> None:
        """`max_waiting_requests`: the front end's bound on accepted requests with no token yet,
        past which it refuses new ones (the server's `--max-waiting-requests`); None: unbounded."""
        self.trace = trace
        self.cost = cost
        self.spec = spec
        self.cluster = cluster
        self.vocab_size = vocab_size
        self.progress = progress
        self.clock = [0.0]
        n = cluster.num_instances
        self.instances = [SimInstance(i, spec, cost, self.clock, record_steps) for i in range(n)]
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
        self.dispatcher = Dispatcher(cluster, [spec.num_blocks] * n, spec.block_size)
        self.rebalancer = Rebalancer(cluster)
        self.prefill = set(range(cluster.prefill_instances))
        self.decode = set(range(cluster.prefill_instances, n)) if cluster.disaggregated else set()
        self.live = set(range(n))
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.records: list[RequestRecord] = []
        self.where: dict[str, int] = {}  # request id -> instance
        self.requests: dict[str, Request] = {}
        self.core_reqs: dict[str, EngineCoreRequest] = {}
        self.moving: dict[str, Move] = {}
        self.handoff_to: dict[str, int] = {}
        self.migrations = self.migrations_aborted = self.handoffs = 0
        self.max_waiting_requests = max_waiting_requests
        self.not_started = 0  # accepted requests whose first token is not out yet
        self.refused = 0
        self.usage_timeline: list[tuple[float, list[float]]] = []
        self._last_prefix_report = [-1.0] * n
        self._prefix_versions = [-1] * n
        self._seqs: dict[str, int] = {}

    # -- the loop -----------------------------------------------------------------------

    def _at(self, t: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        for i, r in enumerate(self.trace.requests):
            self._at(r.arrival_s, ARRIVAL, i)
        self._at(0.0, REPORT)
        self._at(0.0, SAMPLE)
        if self.cluster.migration_triggers:
            self._at(self.cluster.migration_interval_s, REBALANCE)
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
            preemptions=sum(inst.scheduler.num_preemptions for inst in self.instances),
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
        self.where[rid] = instance
        if handoff is not None:
            self.handoff_to[rid] = handoff
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
        """As the front end places a request (`AsyncEngineClient._place`)."""
        live = self.live
        if not self.cluster.disaggregated:
            return self.dispatcher.choose(req, live), None
        decode, prefill = self.decode & live, self.prefill & live
        if not decode:
            return self.dispatcher.choose(req, prefill), None
        if not prefill or len(req.prompt_token_ids) < self.cluster.pd_min_prompt_tokens:
            return self.dispatcher.choose(req, decode), None
        return self.dispatcher.choose(req, prefill), self.dispatcher.least_loaded(decode)

    @staticmethod
    def _request(req: EngineCoreRequest, outputs: list[int] | None = None) -> Request:
        return Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.params,
            max_tokens=req.max_tokens,
            arrival_time=req.arrival_time,
            priority=req.priority,
            tenant=req.tenant,
            token_ids=[*req.prompt_token_ids, *outputs] if outputs else [],
        )

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
            elif req.request_id in self.handoff_to and req.num_output_tokens >= 1:
                self._start_move(req.request_id, self.handoff_to.pop(req.request_id), handoff=True)
        gap = self.cost.loop_gap_seconds()
        if gap > 0:  # the loop sends outputs and takes in requests before it plans again
            inst.in_loop_gap = True
            self._at(now + gap, PLAN, index)
        else:
            self._kick(inst)
        return finished

    def _forget(self, rid: str) -> None:
        self.dispatcher.release(rid)
        self.where.pop(rid, None)
        self.requests.pop(rid, None)
        self.core_reqs.pop(rid, None)
        self.handoff_to.pop(rid, None)
        self.moving.pop(rid, None)

    # -- reports ----------------------------------------------------------------------------

    def _report(self) -> None:
        now = self.clock[0]
        for inst in self.instances:
            cache = inst.kv.cache
            hashes = None
            if (
                cache is not None
                and cache.version != self._prefix_versions[inst.index]
                and now - self._last_prefix_report[inst.index] >= PREFIX_REPORT_INTERVAL_S
                and self.cluster.dispatch_policy == "prefix_aware"
            ):
                hashes = cache.block_hashes(MAX_REPORTED_PREFIX_HASHES)
                self._prefix_versions[inst.index] = cache.version
                self._last_prefix_report[inst.index] = now
            stats = Stats(
                num_running=inst.scheduler.num_in_flight,
                num_waiting=inst.scheduler.num_waiting,
                kv_usage=inst.kv.usage,
                num_preemptions=inst.scheduler.num_preemptions,
                prefix_query_tokens=0,
                prefix_hit_tokens=0,
                prompt_tokens=0,
                generation_tokens=0,
                iteration_tokens=[],
                num_blocks=inst.kv.num_blocks,
                num_available_blocks=inst.kv.num_available,
                prefix_hashes=hashes,
                num_seats_taken=inst.scheduler.seats_taken,
                max_num_seqs=inst.spec.max_num_seqs,
            )
            self.dispatcher.observe(inst.index, stats)

    # -- moving requests --------------------------------------------------------------------

    def _rebalance(self) -> None:
        live = self.live if not self.cluster.disaggregated else self.live & self.decode
        views = []
        for rid, instance in self.where.items():
            if rid in self.moving or instance not in live:
                continue
            req = self.requests[rid]
            views.append(
                RequestView(
                    rid,
                    instance,
                    req.priority,
                    req.num_output_tokens > 0,
                    self._seqs[rid],
                    self.dispatcher.demand_of(rid),
                )
            )
        # Seats the moves under way take at their destinations once installed.
        incoming: dict[int, int] = {}
        for move in self.moving.values():
            incoming[move.destination] = incoming.get(move.destination, 0) + 1
        plan = self.rebalancer.plan(self.dispatcher.instances, live, set(), views, len(self.moving), incoming)
        for rid, dest in plan:
            self._start_move(rid, dest, handoff=False)

    def _start_move(self, rid: str, dest: int, handoff: bool) -> None:
        """A live migration's first stage, or a hand-off's pause (its blocks streamed during the
        prefill: none left to copy but the last)."""
        source = self.where[rid]
        req = self.requests[rid]
        if req.status != RequestStatus.RUNNING or source == dest:
            return
        move = Move(rid, source, dest, handoff)
        self.moving[rid] = move
        if handoff:
            self._at(self.clock[0], MOVED, (move, "pause"))
        else:
            self._stage_or_pause(move, req)

    def _stage_or_pause(self, move: Move, req: Request) -> None:
        """As the engine's sender after a stage landed: another stage if enough blocks were filled
        meanwhile and stages are left, else the pause."""
        new = req.num_computed_tokens // self.spec.block_size - move.sent
        if new > MIGRATION_STOP_BLOCKS and move.stages < MIGRATION_MAX_STAGES:
            move.sent += new
            move.stages += 1
            self._at(self.clock[0] + self.cost.transfer_seconds(new), MOVED, (move, "stage"))
        else:
            self._at(self.clock[0], MOVED, (move, "pause"))

    def _moved(self, payload: tuple[Move, str]) -> None:
        move, phase = payload
        if self.moving.get(move.request_id) is not move:
            return  # the request finished meanwhile
        req = self.requests[move.request_id]
        src = self.instances[move.source]
        if req.status != RequestStatus.RUNNING and phase != "install":  # preempted meanwhile: given up
            del self.moving[move.request_id]
            self.migrations_aborted += 1
            return
        if phase == "stage":
            self._stage_or_pause(move, req)
        elif phase == "pause":
            src.scheduler.pause(req)
            bs = self.spec.block_size
            last = -(-req.num_computed_tokens // bs) - (0 if move.handoff else move.sent)
            self._at(self.clock[0] + self.cost.transfer_seconds(max(1, last)), MOVED, (move, "install"))
        else:
            self._install(move, req)

    def _install(self, move: Move, req: Request) -> None:
        src, dst = self.instances[move.source], self.instances[move.destination]
        del self.moving[move.request_id]
        bs = self.spec.block_size
        need = -(-req.num_computed_tokens // bs)
        core = self.core_reqs[move.request_id]
        blocks = dst.kv.take_blocks(need) if dst.scheduler.seats_taken + 1 <= dst.spec.max_num_seqs else None
        if blocks is None:
            src.scheduler.unpause(req)  # no room there: it goes on here
            self.migrations_aborted += 1
            self._kick(src)
            return
        moved = self._request(core, req.output_token_ids)
        moved.num_computed_tokens = req.num_computed_tokens
        dst.kv.give(moved, blocks, add_reference=False)
        moved.first_scheduled_time = req.first_scheduled_time
        moved.first_token_time = req.first_token_time
        moved.num_preemptions = req.num_preemptions
        src.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
        dst.scheduler.adopt(moved)
        self.requests[move.request_id] = moved
        self.where[move.request_id] = move.destination
        self.records[self._seqs[move.request_id]].num_moves += 1
        self.dispatcher.routed(core, move.destination)
        if move.handoff:
            self.handoffs += 1
        else:
            self.migrations += 1
        self._kick(src)
        self._kick(dst)
