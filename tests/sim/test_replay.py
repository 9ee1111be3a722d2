"""Replay fidelity: a real run of engine cores (the test model, in this process) records its step
trace; the simulator, driven by those recorded step durations (tandem/sim/replay.py), runs every
step with the shape the engine planned and hands every request its tokens when the real run did,
at one instance and at two behind the real placement and dispatcher. The real run keeps its own
clock: each step lasts what it took on this machine, whatever that was, and the replay must match
it, so the comparison is of scheduling, not of speed."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest
from tandem.core.step_shape import StepShape
from tandem.engine.core import EngineCore
from tandem.engine.placement import place
from tandem.engine.step_trace import StepTrace
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


class Captured:
    """Stands in for an engine's step trace: keeps each working step's duration and shape."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, StepShape, int]] = []

    def record(self, began: float, elapsed: float, shape: StepShape, waiting: int, arrivals=None) -> None:
        self.steps.append((elapsed, shape, waiting))


def real_run(
    model: Path, trace: Trace, cluster: ClusterConfig, vocab: int, trace_path: Path
) -> dict[str, list[float]]:
    """The trace served by real engine cores on the run's own clock: a step started at t ends at
    t + the seconds it took, its tokens out then; requests placed as the server places them.
    Writes the step trace (engine i as pid i) and returns each request's token times."""
    n = cluster.num_instances
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=SEQS,
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
        if busy[i] or not cores[i].has_unfinished_requests():
            return
        before = len(captured[i].steps)
        outs = cores[i].step()
        elapsed = 0.0  # an empty step: none recorded, no time spent
        if len(captured[i].steps) > before:
            elapsed, shape, waiting = captured[i].steps[-1]
            elapsed = round(elapsed, 6)  # as the trace file keeps it
            out_traces[i].record(now[0], elapsed, shape, waiting)
        busy[i] = True
        heapq.heappush(events, (now[0] + elapsed, next(seq), "step", (i, outs)))

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
            i, _ = place(req, dispatcher, None, live, live)
            dispatcher.routed(req, i)
            times[req.request_id] = []
            cores[i].add_request(req)
            start(i)
        else:
            i, outs = payload
            busy[i] = False
            for so in outs:
                times[so.request_id] += [now[0]] * len(so.new_token_ids)
                if so.finish_reason is not None:
                    dispatcher.release(so.request_id)
            start(i)
    for t in out_traces:
        t.close()
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
    from tandem.sim.cost import load_cost, save_cost

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
