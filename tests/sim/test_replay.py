"""Replay fidelity: a real run of engine cores (the test model, in this process) records its step
trace; the simulator, driven by those recorded step durations (tandem/sim/replay.py), runs every
step with the shape the engine planned and hands every request its tokens when the real run did,
at one instance and at two behind the real placement and dispatcher. The real run keeps its own
clock: each step lasts what it took on this machine, whatever that was, and the replay must match
it, so the comparison is of scheduling, not of speed. A run whose front end and loop take time of
their own (`FrontEndDelays`) replays from what its step trace recorded (tandem/sim/replay_run.py)."""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest
from tandem.core.step_shape import StepShape
from tandem.engine.core import EngineCore
from tandem.engine.front_trace import FrontEndTrace
from tandem.engine.placement import place
from tandem.engine.step_trace import StepTrace
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.plane import KVPlane
from tandem.kvtransfer.transport import Message
from tandem.sampling_params import SamplingParams
from tandem.sim.cost import FrontEndCpu
from tandem.sim.instance import InstanceSpec
from tandem.sim.replay import replay_costs
from tandem.sim.simulator import ClusterSim
from tandem.sim.trace import Trace, synthetic

BLOCKS, BLOCK_SIZE, SEQS, BUDGET, MAX_LEN = 96, 4, 6, 48, 512


@dataclass
class NoFrontEnd:
    """What is not replayed: no way in or out, no loop gap (the real run below has none either)."""

    name: str = "none"

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        raise AssertionError("every working step is replayed")

    def transfer_seconds(self, num_blocks: int) -> float:
        return 0.001

    def delivery_seconds(self) -> float:
        return 0.0

    def ingress_seconds(self) -> float:
        return 0.0

    def loop_gap_seconds(self) -> float:
        return 0.0

    def co_run_slowdown(self, running: int) -> float:
        return 1.0

    def front_end_cpu(self) -> FrontEndCpu:
        return FrontEndCpu()


@dataclass
class PastTheRecord(NoFrontEnd):
    """A replay whose schedule parts from the run's: steps past the recorded ones take 5 ms."""

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        return 0.005


class Captured:
    """Stands in for an engine's step trace: keeps each working step's duration, shape and the
    requests it made first tokens for and finished (the harness writes them on its own clock)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, StepShape, int, list[str], list[tuple[str, int]]]] = []

    def added(self, request_id: str, at: float, arrival: float) -> None:
        pass  # the harness records the way in on its own clock

    def record(self, began, elapsed, shape, waiting, arrivals=None, first=None, done=None) -> None:
        self.steps.append((elapsed, shape, waiting, list(first or []), list(done or [])))


@dataclass
class FrontEndDelays:
    """Times a served run spends outside its steps, drawn per request and per step (seeded): the
    API process's time from taking a request in to placing it, the way from there to the engine,
    the loop's gap after each step, the pick-up of a request by an idle engine, and the time from a
    request's last step to the front end releasing it from the dispatcher's count."""

    seed: int = 0
    place_s: tuple[float, float] = (0.0001, 0.002)
    ingress_s: tuple[float, float] = (0.0005, 0.006)
    release_s: tuple[float, float] = (0.001, 0.03)
    loop_gap_s: tuple[float, float] = (0.0001, 0.003)
    pickup_s: tuple[float, float] = (0.00005, 0.0008)
    kv_s: tuple[float, float] = (0.0005, 0.004)  # a KV message's way to the other engine

    rngs: dict[str, random.Random] = field(default_factory=dict, repr=False)

    def draw(self, kind: str) -> float:
        """The next delay of one kind; each kind draws on its own (seeded) sequence, so the
        placement delays, drawn in arrival order, do not depend on how many steps ran."""
        rng = self.rngs.setdefault(kind, random.Random(f"{self.seed}-{kind}"))
        return rng.uniform(*getattr(self, kind))


def real_run(
    model: Path,
    trace: Trace,
    cluster: ClusterConfig,
    vocab: int,
    trace_path: Path,
    delays: FrontEndDelays | None = None,
    moves: dict[str, int] | None = None,
    num_blocks: int = BLOCKS,
    max_num_seqs: int = SEQS,
) -> dict[str, list[float]]:
    """The trace served by real engine cores on the run's own clock: a step started at t ends at
    t + the seconds it took, its tokens out then; requests placed as the server places them.
    With `delays`, a request reaches its engine some time after the front end placed it, the loop
    waits after each step and an idle engine takes a moment to start; without, none of that takes
    time. Writes the step trace (engine i as pid i, with each request's way in, first token and
    finish) and returns each request's token times.

    `moves` (with `delays`): request id -> the output count at which the front end moves it, live,
    to the other instance; the engines' KV planes talk over a transport of the run's clock (each
    message `kv_s` on its way, in order per pair of engines), handle what arrived before each step
    (or at once, idle) and act after each, as the engine loop does, and record their acts in the
    step trace."""
    n = cluster.num_instances
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_LEN,
        num_threads=1,
    )
    now = [0.0]
    cores = [EngineCore(config) for _ in range(n)]
    captured = [Captured() for _ in range(n)]
    out_traces = [StepTrace(trace_path, pid=i) for i in range(n)]
    for core, cap in zip(cores, captured):
        core.step_trace = cap  # type: ignore[assignment]
        core.scheduler.clock = lambda: now[0]
    dispatcher = Dispatcher(cluster, [BLOCKS] * n, BLOCK_SIZE)
    live = set(range(n))
    events: list = []
    seq = itertools.count()
    busy = [False] * n
    times: dict[str, list[float]] = {}

    def start(i: int) -> None:
        if busy[i]:
            return
        if planes:  # the loop's pass: what arrived (the front end's, the KV plane's), then the step
            while orders[i]:
                planes[i].sender.start(orders[i].popleft())
            planes[i].handle()
            planes[i].tick()
        if not cores[i].has_unfinished_requests():
            return
        before = len(captured[i].steps)
        outs = cores[i].step()
        elapsed = 0.0  # an empty step: none recorded, no time spent
        if len(captured[i].steps) > before:
            elapsed, shape, waiting, first, done = captured[i].steps[-1]
            elapsed = round(elapsed, 6)  # as the trace file keeps it
            out_traces[i].record(now[0], elapsed, shape, waiting, first=first, done=done)
        busy[i] = True
        heapq.heappush(events, (now[0] + elapsed, next(seq), "step", (i, outs)))

    front = FrontEndTrace(trace_path) if delays is not None else None
    planes: list[KVPlane] = []
    inboxes: list[deque[Message]] = [deque() for _ in range(n)]
    orders: list[deque[p.MigrateOut]] = [deque() for _ in range(n)]  # from the front end
    last_kv = [[0.0] * n for _ in range(n)]  # per pair of engines: when its last message arrives
    reqs: dict[str, EngineCoreRequest] = {}
    where: dict[str, int] = {}

    class ClockedTransport:
        """Engine i's KV inbox on the run's clock."""

        socket = None

        def __init__(self, i: int) -> None:
            self.i = i
            self.address = f"kv{i}"

        def send(self, peer: str, header: bytes, payload=None) -> None:
            assert delays is not None
            j = int(peer[2:])
            data = None if payload is None else memoryview(bytes(memoryview(payload)))
            at = last_kv[self.i][j] = max(last_kv[self.i][j], now[0] + delays.draw("kv_s"))
            heapq.heappush(events, (at, next(seq), "kv", (j, Message(header, data))))

        def recv(self) -> Message | None:
            return inboxes[self.i].popleft() if inboxes[self.i] else None

        def close(self) -> None:
            pass

    def report(i: int, msg: p.Migrated | p.TransferDropped) -> None:
        """A plane's word to the front end, on its way there."""
        assert delays is not None
        heapq.heappush(events, (now[0] + delays.draw("release_s"), next(seq), "migrated", (i, msg)))

    if moves:
        for i, core in enumerate(cores):
            planes.append(
                KVPlane(
                    core,
                    ClockedTransport(i),
                    functools.partial(report, i),
                    timeout_s=1e9,
                    max_stages=config.migration_max_stages,
                    stop_blocks=config.migration_stop_blocks,
                    clock=lambda: now[0],
                    log=out_traces[i].move,
                )
            )

    def place_request(req: EngineCoreRequest) -> None:
        i, _ = place(req, dispatcher, None, live, live)
        dispatcher.routed(req, i)
        reqs[req.request_id], where[req.request_id] = req, i
        if front is not None:
            front.event("placed", req.request_id, now[0])
        times[req.request_id] = []
        ingress = 0.0 if delays is None else delays.draw("ingress_s")
        heapq.heappush(events, (now[0] + ingress, next(seq), "admit", (i, req)))

    def wake(i: int) -> None:
        """An idle engine that has just taken a request in starts its step after a pick-up time."""
        if busy[i]:
            return
        if delays is None:
            start(i)
            return
        busy[i] = True
        heapq.heappush(events, (now[0] + delays.draw("pickup_s"), next(seq), "plan", i))

    for index, r in enumerate(trace.requests):
        heapq.heappush(events, (r.arrival_s, next(seq), "arrival", index))
    while events:
        now[0], _, kind, payload = heapq.heappop(events)
        if kind == "arrival":
            r = trace.requests[payload]
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            prompt = trace.prompt_token_ids(payload, vocab)
            req = EngineCoreRequest(
                f"r{payload}", prompt, params, r.output_len, r.arrival_s, r.priority, r.tenant
            )
            if delays is None:
                place_request(req)
            else:
                heapq.heappush(events, (now[0] + delays.draw("place_s"), next(seq), "place", req))
        elif kind == "place":
            place_request(payload)
        elif kind == "release":
            dispatcher.release(payload)
            assert front is not None
            front.event("released", payload, now[0])
        elif kind == "admit":
            i, req = payload
            out_traces[i].added(req.request_id, now[0], req.arrival_time)
            cores[i].add_request(req)
            wake(i)
        elif kind == "plan":
            busy[payload] = False
            start(payload)
        elif kind == "kv":
            j, msg = payload
            inboxes[j].append(msg)
            if not busy[j]:  # an idle engine's loop takes it at once
                planes[j].handle()
                if cores[j].has_unfinished_requests():
                    wake(j)
        elif kind == "move":  # MigrateOut reaches the source, which takes it before its next step
            i, msg = payload
            orders[i].append(msg)
            if not busy[i]:
                start(i)
        elif kind == "migrated":
            i, msg = payload
            assert front is not None
            front.move("landed", msg.request_id, now[0], outcome=msg.outcome.value)
            if msg.outcome is p.MoveOutcome.COMPLETED:
                dest = 1 - i
                where[msg.request_id] = dest
                dispatcher.routed(reqs[msg.request_id], dest)
        else:
            i, outs = payload
            if planes:
                planes[i].after_step()
            for so in outs:
                times[so.request_id] += [now[0]] * len(so.new_token_ids)
                rid = so.request_id
                if moves and len(times[rid]) == moves.get(rid) and so.finish_reason is None:
                    assert delays is not None and front is not None
                    dest = 1 - where[rid]
                    front.move("decided", rid, now[0], source=where[rid], destination=dest)
                    out = p.MigrateOut(replace(reqs[rid], incarnation=1), f"{rid}@1", f"kv{dest}")
                    at = now[0] + delays.draw("ingress_s")
                    heapq.heappush(events, (at, next(seq), "move", (where[rid], out)))
                if so.finish_reason is None:
                    continue
                if delays is None:
                    dispatcher.release(so.request_id)
                else:
                    heapq.heappush(events, (now[0] + delays.draw("release_s"), next(seq), "release", so.request_id))
            if delays is None or not cores[i].has_unfinished_requests():
                busy[i] = False
                start(i)
            else:  # the loop's gap: requests taken in meanwhile join the next step
                heapq.heappush(events, (now[0] + delays.draw("loop_gap_s"), next(seq), "plan", i))
    for t in out_traces:
        t.close()
    if front is not None:
        front.close()
    return times


@pytest.mark.slow
@pytest.mark.parametrize(
    "cluster",
    [ClusterConfig(num_instances=1), ClusterConfig(num_instances=2, dispatch_policy="least_load")],
    ids=["one", "two"],
)
def test_replayed_steps_reproduce_the_real_runs_token_times(cluster, llama_dir, tmp_path):
    vocab = 200
    trace = synthetic(
        14,
        40.0,
        burstiness=0.5,
        prompt_len=(16, 120),
        output_len=(4, 40),
        seed=3,
        num_prefix_groups=2,
        prefix_len=16,
    )
    path = tmp_path / "steps.jsonl"
    real = real_run(llama_dir, trace, cluster, vocab, path)

    spec = InstanceSpec(BLOCKS, BLOCK_SIZE, SEQS, BUDGET, MAX_LEN)
    costs = replay_costs(NoFrontEnd(), str(path), cluster.num_instances, pids=range(cluster.num_instances))
    sim = ClusterSim(trace, NoFrontEnd(), spec, cluster, vocab_size=vocab, instance_costs=costs)  # type: ignore[arg-type]
    result = sim.run()

    for c in costs:  # every recorded step ran, with the shape the engine planned, and no other
        assert c.steps.diverged == 0, c.steps.first_divergence
        assert c.steps.served == len(c.steps.durations) > 0 and c.steps.extra == 0
    assert len({rec.instance for rec in result.records}) == cluster.num_instances
    for rec in result.records:
        expect = real[f"r{rec.index}"]
        assert len(rec.token_times) == len(expect) == rec.output_len
        ttft, real_ttft = rec.token_times[0] - rec.arrival_s, expect[0] - rec.arrival_s
        assert ttft == pytest.approx(real_ttft, rel=1e-6, abs=1e-9), rec.index
        itl = [b - a for a, b in itertools.pairwise(rec.token_times)]
        real_itl = [b - a for a, b in itertools.pairwise(expect)]
        assert itl == pytest.approx(real_itl, rel=1e-6, abs=1e-9), rec.index


def test_a_simulation_replayed_from_its_own_step_trace_repeats_itself(tmp_path):
    """`tandem simulate --replay-steps`: a simulated run (two instances, least_load, imbalance
    migration) written as a step trace and replayed over another step-time model gives every
    request the same token times: the schedule, the dispatch and the moves are the same."""
    from dataclasses import replace

    from tandem.entrypoints.cli import build_parser
    from tandem.sim.cli import DEFAULT_COST, build, write_step_trace
    from tandem.sim.cost import FittedCost, load_cost, save_cost

    common = ["simulate", "--num-requests", "60", "--request-rate", "30", "--instances", "2"]
    common += ["--migration-triggers", "imbalance", "--num-kv-blocks", "256", "--max-num-seqs", "16"]
    common += ["--prompt-len", "32,400", "--output-len", "8,80", "--seed", "4"]
    steps = tmp_path / "steps.jsonl"
    first = build(build_parser().parse_args([*common, "--step-trace", str(steps)]))
    original = first.run()
    assert original.migrations > 0
    write_step_trace(first, str(steps))
    # The same front-end times, steps ten times slower: what the replay must not use for a step it
    # has recorded.
    base = load_cost(str(DEFAULT_COST))
    assert isinstance(base, FittedCost)
    other = tmp_path / "other-cost.json"
    save_cost(replace(base, coefficients={k: 10 * v for k, v in base.coefficients.items()}), str(other))
    again = build(build_parser().parse_args([*common, "--cost", str(other), "--replay-steps", str(steps)]))
    replayed = again.run()
    assert [inst.cost.steps.diverged for inst in again.instances] == [0, 0]
    assert [inst.cost.steps.extra for inst in again.instances] == [0, 0]
    assert replayed.migrations == original.migrations
    for a, b in zip(original.records, replayed.records):
        # (the trace keeps durations to the microsecond: a token's time drifts by at most that a step)
        assert a.instance == b.instance and b.token_times == pytest.approx(
            a.token_times, abs=1e-6 * replayed.steps
        ), a.index


@pytest.mark.slow
@pytest.mark.parametrize(
    "cluster",
    [ClusterConfig(num_instances=1), ClusterConfig(num_instances=2, dispatch_policy="least_load")],
    ids=["one", "two"],
)
def test_a_run_with_front_end_and_loop_times_replays_from_its_own_records(cluster, llama_dir, tmp_path):
    """A run whose requests take time to reach their engine, whose loop waits after each step and
    whose idle engines take a moment to start (`FrontEndDelays`) replays from its step trace
    alone (`replay_served_run`: the recorded ways in and gaps, not a cost model's) with every step
    of the engine's shape, every request on its engine and every token at the run's time."""
    from tandem.engine.step_trace import front_end_events, read_step_trace
    from tandem.sim.replay_run import replay_served_run, served_requests

    vocab = 200
    trace = synthetic(
        16, 40.0, burstiness=0.5, prompt_len=(16, 120), output_len=(4, 40), seed=5, num_prefix_groups=2, prefix_len=16
    )
    path = tmp_path / "steps.jsonl"
    real = real_run(llama_dir, trace, cluster, vocab, path, FrontEndDelays(seed=1))
    lines, front = read_step_trace(path), front_end_events(path)
    served = served_requests(lines, front)
    assert [r.request_id for r in served] == [f"r{i}" for i in range(len(trace.requests))]
    # (placed in another order than they arrived: the replay places them as the front end did)
    assert sorted(served, key=lambda r: r.placed) != served  # type: ignore[arg-type,return-value]
    # The way in took time, as drawn, and so did the front end's release.
    assert all(r.arrival < r.placed < r.added and r.finished < r.released for r in served)  # type: ignore[operator]
    gaps = [b["start"] - a["start"] - a["seconds"] for a, b in itertools.pairwise(lines) if a["pid"] == b["pid"]]
    assert min(gaps) > 0  # and so did the loop

    spec = InstanceSpec(BLOCKS, BLOCK_SIZE, SEQS, BUDGET, MAX_LEN)
    report = replay_served_run(trace, lines, spec, cluster, NoFrontEnd(), vocab, front)
    summary = report.summary()
    assert report.diverged == 0 and report.unrecorded == 0, report.first_divergence
    assert report.steps == len(lines) and not report.missing
    assert summary["placed_elsewhere"] == 0 and summary["requests_within_2pct"] == len(trace.requests)
    assert len({rec.instance for rec in report.result.records}) == cluster.num_instances
    for index, r in enumerate(trace.requests):
        got, expect = report.token_times[f"r{index}"], real[f"r{index}"]
        assert len(got) == len(expect) == r.output_len
        assert got == pytest.approx(expect, rel=0, abs=1e-6), index

    # The recorded gaps are what keeps the schedules together: the same steps with the loop's gaps
    # and the ways in left out part from the run.
    from tandem.sim.replay import replay_costs

    costs = replay_costs(PastTheRecord(), str(path), cluster.num_instances, pids=range(cluster.num_instances))
    ClusterSim(trace, PastTheRecord(), spec, cluster, vocab_size=vocab, instance_costs=costs).run()  # type: ignore[arg-type]
    assert sum(c.steps.diverged for c in costs) > 0


@pytest.mark.slow
def test_a_run_with_a_live_move_replays_the_move_as_recorded(llama_dir, tmp_path):
    """Two engine cores with their KV planes; the front end moves a long request (held running by
    ignore_eos and 100 tokens to go) to the other instance live. The replay takes the move from
    the record (`move_lines`) and runs the protocol itself: every step of the engines' shapes, every
    stage and the pause after the same step with the same blocks, the install where the
    destination did it, and every token at the run's time. A replay whose install comes one
    destination step later than recorded parts from the run."""
    from tandem.engine.step_trace import front_end_events, move_lines, read_step_trace
    from tandem.sim.replay_run import replay_served_run

    # Room and seats for all on either instance: the move is never refused or preempted, whatever
    # the machine's speed.
    vocab, blocks, seats = 200, 512, 16
    cluster = ClusterConfig(num_instances=2, dispatch_policy="least_load")
    trace = synthetic(
        12, 40.0, burstiness=0.5, prompt_len=(16, 120), output_len=(4, 40), seed=5, num_prefix_groups=2, prefix_len=16
    )
    trace = Trace(
        [replace(r, output_len=110) if i == 0 else r for i, r in enumerate(trace.requests)],
        trace.hash_block_tokens,
        trace.name,
    )
    path = tmp_path / "steps.jsonl"
    real = real_run(
        llama_dir, trace, cluster, vocab, path, FrontEndDelays(seed=2), moves={"r0": 10}, num_blocks=blocks, max_num_seqs=seats
    )
    lines, front, moves = read_step_trace(path), front_end_events(path), move_lines(path)
    kinds = [m["move"] for m in moves]
    # The run moved r0 live: begun, copied in a stage while it decoded, paused, installed, ended.
    assert {m["request"] for m in moves} == {"r0"}
    assert kinds.count("decided") == kinds.count("begin") == kinds.count("install") == kinds.count("pause") == 1, moves
    assert kinds.count("stage") >= 1 and [m["outcome"] for m in moves if m["move"] == "landed"] == ["completed"]

    spec = InstanceSpec(blocks, BLOCK_SIZE, seats, BUDGET, MAX_LEN)
    report = replay_served_run(trace, lines, spec, cluster, NoFrontEnd(), vocab, front, moves)
    summary = report.summary()
    assert report.diverged == 0 and report.unrecorded == 0, report.first_divergence
    assert summary["moves_run"] == summary["moves_replay"] == 1
    assert summary["move_acts_alike"] == summary["move_acts"] == len(report.acts) > 0, report.acts
    assert summary["stages_replay"] == summary["stages_run"] >= 1
    assert summary["placed_elsewhere"] == 0 and summary["requests_within_2pct"] == len(trace.requests)
    moved = report.result.records[0]
    assert moved.num_moves == 1
    for index, r in enumerate(trace.requests):
        got, expect = report.token_times[f"r{index}"], real[f"r{index}"]
        assert len(got) == len(expect) == r.output_len
        assert got == pytest.approx(expect, rel=0, abs=1e-6), index

    # The move's timing is the record's: an install one destination step later parts from the run.
    install = next(m for m in moves if m["move"] == "install")
    dest = [line for line in lines if line["pid"] == install["pid"]]
    later = dest[install["step"]]  # the step the destination ran next
    shifted = [
        {**m, "step": m["step"] + 1, "at": later["start"] + later["seconds"]} if m is install else m for m in moves
    ]
    off = replay_served_run(trace, lines, spec, cluster, PastTheRecord(), vocab, front, shifted)
    assert off.diverged > 0
    assert off.token_times["r0"] != pytest.approx(real["r0"], rel=0, abs=1e-6)
