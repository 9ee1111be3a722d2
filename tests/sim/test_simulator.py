"""The cluster simulator runs the production scheduling code: every request runs to its length,
every instance ends with its KV pool free (or held only by the idle prefix cache), the same inputs
give the same result, and policies (dispatch, migration, prefill/decode) show in the outcome."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tandem.cluster.config import ClusterConfig
from tandem.sim.cost import FrontEndCpu, StepShape
from tandem.sim.frontend import FrontEnd
from tandem.sim.instance import InstanceSpec
from tandem.sim.report import summary
from tandem.sim.simulator import ClusterSim
from tandem.sim.trace import Trace, TraceRequest, synthetic

NO_FRONT_END = FrontEndCpu()


@dataclass
class LinearToy:
    """A step costs 5 ms plus 0.1 ms per prefill token and 0.2 ms per decode row."""

    name: str = "toy"
    delivery: float = 0.0
    ingress: float = 0.0
    loop_gap: float = 0.0
    penalty: float = 0.0
    front_end: FrontEndCpu = NO_FRONT_END

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        return 0.005 + 1e-4 * shape.prefill_tokens + 2e-4 * shape.decode_rows

    def transfer_seconds(self, num_blocks: int) -> float:
        return 0.001 + 1e-5 * num_blocks

    def delivery_seconds(self) -> float:
        return self.delivery

    def ingress_seconds(self) -> float:
        return self.ingress

    def loop_gap_seconds(self) -> float:
        return self.loop_gap

    def co_run_slowdown(self, running: int) -> float:
        return 1.0 + self.penalty * (running - 1)

    def front_end_cpu(self) -> FrontEndCpu:
        return self.front_end


SPEC = InstanceSpec(
    num_blocks=512, block_size=16, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096
)


def simulate(trace: Trace, spec: InstanceSpec = SPEC, **cluster) -> tuple[ClusterSim, dict]:
    sim = ClusterSim(trace, LinearToy(), spec, ClusterConfig(**cluster))
    result = sim.run()
    for inst in sim.instances:
        assert not inst.scheduler.requests and not inst.busy
        assert inst.kv.num_available == inst.kv.num_blocks
        inst.kv.check_invariants()
    for rec in result.records:
        assert len(rec.token_times) == rec.output_len, rec
        assert rec.token_times == sorted(rec.token_times) and rec.first_token_s >= rec.arrival_s
    return sim, summary(result)


def test_every_request_runs_to_its_length_and_nothing_is_held():
    trace = synthetic(300, 40.0, burstiness=0.5, prompt_len=(16, 600), output_len=(4, 120), seed=1)
    _, run = simulate(trace, num_instances=3)
    assert run["completed"] == 300 and run["failed"] == 0
    assert run["ttft_ms"]["mean"] > 0 and run["output_throughput"] > 0


def test_a_request_too_long_for_the_instances_fails_and_the_run_ends():
    """Refused at dispatch (prompt + output beyond max_model_len), as the server answers 400; the
    simulation still ends (it waited for ever on a request that never ran)."""
    trace = Trace([TraceRequest(0.0, 4000, 200), TraceRequest(0.1, 100, 10)], hash_block_tokens=16)
    sim = ClusterSim(trace, LinearToy(), SPEC, ClusterConfig(num_instances=1))
    run = summary(sim.run())
    assert run["completed"] == 1 and run["failed"] == 1


def test_same_inputs_same_result():
    trace = synthetic(200, 30.0, prompt_len=(300, 900), num_prefix_groups=4, prefix_len=256, seed=2)
    a = simulate(trace, num_instances=2, dispatch_policy="prefix_aware")[1]
    b = simulate(trace, num_instances=2, dispatch_policy="prefix_aware")[1]
    assert a == b


def test_prefix_aware_dispatch_reuses_more_prefix_than_round_robin():
    trace = synthetic(
        400, 60.0, prompt_len=(600, 700), output_len=(8, 16), num_prefix_groups=8, prefix_len=512, seed=3
    )
    rr, _ = simulate(trace, num_instances=4, dispatch_policy="round_robin")
    pa, _ = simulate(trace, num_instances=4, dispatch_policy="prefix_aware")
    hits = [sum(i.scheduler.counters.prefix_cache_hits for i in s.instances) for s in (rr, pa)]
    assert hits[1] > hits[0], hits


def test_overload_preempts_and_migration_moves_requests():
    # Two instances, and round robin puts every long request on instance 0: imbalance moves some.
    reqs = [TraceRequest(0.01 * i, 64, 400 if i % 2 == 0 else 4) for i in range(60)]
    trace = Trace(reqs)
    _, still = simulate(trace, num_instances=2, dispatch_policy="round_robin")
    _, moved = simulate(
        trace,
        num_instances=2,
        dispatch_policy="round_robin",
        migration_triggers=("imbalance",),
        imbalance_threshold=0.05,
    )
    assert still["migrations"] == 0 and moved["migrations"] > 0


def test_prefill_decode_hands_every_long_prompt_over():
    trace = synthetic(100, 20.0, prompt_len=(8, 800), output_len=(4, 40), seed=4)
    sim, run = simulate(
        trace, num_instances=3, prefill_instances=1, decode_instances=2, pd_min_prompt_tokens=64
    )
    long = sum(r.prompt_len >= 64 for r in trace.requests)
    assert run["handoffs"] == long
    assert all(rec.instance in (0, 1, 2) for rec in sim.records)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_scheduling_policies_run(policy):
    from tandem.core.policy import SchedulingConfig

    spec = InstanceSpec(
        num_blocks=128,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        scheduling=SchedulingConfig(policy=policy),
    )
    trace = synthetic(
        80, 50.0, prompt_len=(32, 300), output_len=(8, 64), priorities={0: 0.7, -1: 0.3}, seed=5
    )
    _, run = simulate(trace, spec, num_instances=1)
    assert run["completed"] == 80


def test_delivery_time_shifts_what_clients_see_and_nothing_else():
    """The front end's share (cost.delivery_seconds) delays every token a client sees by exactly that
    much: TTFT and E2E grow by it, inter-token gaps and the engine's own steps do not change."""
    trace = synthetic(60, 30.0, prompt_len=(16, 200), output_len=(4, 40), seed=3)
    spec_args = (SPEC, ClusterConfig(num_instances=2, dispatch_policy="least_load"))
    plain = ClusterSim(trace, LinearToy(), *spec_args).run()
    late = ClusterSim(trace, LinearToy(delivery=0.025), *spec_args).run()
    assert plain.steps == late.steps
    for a, b in zip(plain.records, late.records, strict=True):
        assert b.first_token_s == pytest.approx(a.first_token_s + 0.025)
        assert b.finish_s == pytest.approx(a.finish_s + 0.025)
        assert b.token_times == pytest.approx([t + 0.025 for t in a.token_times])


def test_front_end_queues_take_messages_and_tokens_one_at_a_time():
    """The API process works through a message (per-message CPU, then each token's), the client
    through the tokens as they come out of it (its per-message CPU before a message's first);
    messages that come while either is busy wait; a one-token message at an idle front end takes
    the measured delivery, whatever the split."""
    cpu = FrontEndCpu(api_message_s=0.001, api_token_s=0.0001, client_message_s=0.0005, client_token_s=0.0003)
    fe = FrontEnd(LinearToy(delivery=0.005, front_end=cpu))
    assert fe.deliver(0.0, 1) == pytest.approx([0.005])
    hop = 0.005 - 0.0019
    # API: tokens out at 1.0011, 1.0012, 1.0013; the client (slower) is the bottleneck after the first.
    first = fe.deliver(1.0, 3)
    assert first == pytest.approx([t + hop for t in (1.0019, 1.0022, 1.0025)])
    # The next message comes while the API is free but the client is still busy with the first.
    second = fe.deliver(1.0012, 2)
    assert second == pytest.approx([t + hop for t in (1.0025 + 0.0008, 1.0025 + 0.0011)])
    assert fe.deliver(5.0, 1, slowdown=2.0) == pytest.approx(
        [5.0 + 2 * 0.0019 + hop]
    )  # the hop does not stretch
    assert fe.deliver(6.0, 0) == []
    plain = FrontEnd(LinearToy(delivery=0.005))  # no front-end figures: a fixed delivery
    assert plain.deliver(0.0, 4) == [0.005] * 4 and plain.deliver(0.0, 4) == [0.005] * 4


def test_front_end_queue_grows_with_the_load_and_leaves_the_engine_alone():
    """The same delivery at light load either way; under load the front end's queue adds to what
    clients see (TTFT, E2E) but not to the engine's steps."""

    def run(rate: float, **fe: float) -> tuple[dict, int]:
        trace = synthetic(150, rate, prompt_len=(16, 200), output_len=(8, 40), seed=4)
        sim = ClusterSim(trace, LinearToy(delivery=0.005, **fe), SPEC, ClusterConfig(num_instances=1))
        result = sim.run()
        for rec in result.records:
            assert len(rec.token_times) == rec.output_len
            assert rec.token_times == sorted(rec.token_times) and rec.finish_s == rec.token_times[-1]
        return summary(result), result.steps

    queued = {"front_end": FrontEndCpu(0.0003, 0.0001, 0.0, 0.00015)}
    light, light_q = run(0.5)[0], run(0.5, **queued)[0]
    assert light_q["ttft_ms"]["mean"] == pytest.approx(light["ttft_ms"]["mean"], rel=0.02)
    (busy, steps), (busy_q, steps_q) = run(200.0), run(200.0, **queued)
    assert steps == steps_q
    assert busy_q["ttft_ms"]["mean"] > busy["ttft_ms"]["mean"] + 1.0


def test_ingress_and_loop_gap_delay_the_engine_as_served():
    """A request reaches its engine `ingress_seconds` after it arrives, and each step is followed by
    the loop's gap: requests alone on an instance see their first token later by exactly the ingress
    (their step starts as they reach the idle engine), and each next token one step plus one gap
    after the last; the steps' busy time is unchanged."""
    trace = Trace([TraceRequest(arrival_s=float(i), prompt_len=64, output_len=5) for i in range(4)])
    args = (SPEC, ClusterConfig(num_instances=1))
    plain = ClusterSim(trace, LinearToy(), *args).run()
    slow = ClusterSim(trace, LinearToy(ingress=0.003, loop_gap=0.002), *args).run()
    assert plain.steps == slow.steps and slow.busy_fraction[0] * slow.duration_s == pytest.approx(
        plain.busy_fraction[0] * plain.duration_s
    )
    decode_step = 0.005 + 2e-4
    for a, b in zip(plain.records, slow.records, strict=True):
        assert b.first_token_s == pytest.approx(a.first_token_s + 0.003)
        gaps = [y - x for x, y in zip(b.token_times, b.token_times[1:])]
        assert gaps == pytest.approx([decode_step + 0.002] * 4)


def test_a_shared_host_slows_steps_by_the_co_run_penalty_and_the_fit_recovers_it(tmp_path):
    """Instances on one host run their steps slower while others run theirs: every request still
    completes, the steps' busy time grows, instances on hosts of their own are untouched; and the
    penalty fitted back from the simulated step trace (as from an engine's) is the one simulated."""
    from tandem.engine.step_trace import read_step_trace
    from tandem.sim.calibrate import co_run_penalty
    from tandem.sim.cli import write_step_trace
    from tandem.sim.cost import FittedCost

    trace = synthetic(120, 40.0, prompt_len=(16, 300), output_len=(4, 60), seed=5)
    cost = FittedCost("lin", {"const": 0.005, "tokens": 1e-4}, co_run_penalty=0.5)
    cluster = ClusterConfig(num_instances=4, dispatch_policy="least_load")
    apart = ClusterSim(trace, cost, SPEC, cluster).run()
    shared_sim = ClusterSim(trace, cost, SPEC, cluster, record_steps=True, instances_per_host=2)
    shared = shared_sim.run()
    for result in (apart, shared):
        assert all(len(r.token_times) == r.output_len for r in result.records)
    busy = lambda r: sum(f * r.duration_s for f in r.busy_fraction)
    assert busy(shared) > 1.1 * busy(apart)
    assert summary(shared)["itl_ms"]["mean"] > summary(apart)["itl_ms"]["mean"]
    # Without a penalty a shared host changes nothing.
    free = FittedCost("lin", {"const": 0.005, "tokens": 1e-4})
    plain = ClusterSim(trace, free, SPEC, cluster).run()
    hosted = ClusterSim(trace, free, SPEC, cluster, instances_per_host=2).run()
    assert [r.token_times for r in plain.records] == [r.token_times for r in hosted.records]
    # Hosts hold instances 0-1 and 2-3: fitted per host, each recovers the penalty.
    path = tmp_path / "steps.jsonl"
    write_step_trace(shared_sim, str(path))
    lines = read_step_trace(path)
    for host in ({0, 1}, {2, 3}):
        fitted = co_run_penalty([line for line in lines if line["pid"] in host], cost)
        assert fitted == pytest.approx(0.5, rel=0.02)
    with pytest.raises(ValueError, match="instances_per_host"):
        ClusterSim(trace, cost, SPEC, cluster, instances_per_host=0)


def test_front_end_on_a_shared_host_slows_with_its_active_instances():
    """On a shared host the front end's ingress and delivery stretch by the host's slowdown at the
    moment: two requests arriving together at idle instances enter their engines the plain ingress
    later (nothing runs yet), and with both instances active their first tokens reach the client
    2x the delivery after their first step (penalty 1.0); on hosts of their own, 1x."""
    trace = Trace([TraceRequest(arrival_s=0.0, prompt_len=64, output_len=3) for _ in range(2)])
    cluster = ClusterConfig(num_instances=2, dispatch_policy="round_robin")
    cost = LinearToy(delivery=0.01, ingress=0.004, penalty=1.0)
    for per_host, factor in ((1, 1.0), (2, 2.0)):
        sim = ClusterSim(trace, cost, SPEC, cluster, record_steps=True, instances_per_host=per_host)
        result = sim.run()
        for rec in result.records:
            start, seconds, _, _ = sim.instances[rec.instance].steps[0]
            assert start == pytest.approx(0.004)
            assert rec.first_token_s == pytest.approx(start + seconds + 0.01 * factor)


def test_front_end_refuses_past_its_waiting_bound_as_the_server_does():
    """With more requests waiting for their first token than `max_waiting_requests`, the front end
    refuses new ones at once (the server's 503 "overloaded"): counted as failed, never dispatched,
    every accepted one still runs to its length; unbounded, all complete."""
    burst = Trace([TraceRequest(arrival_s=0.001 * i, prompt_len=200, output_len=8) for i in range(300)])
    spec = (SPEC, ClusterConfig(num_instances=2, dispatch_policy="least_load"))
    bounded = ClusterSim(burst, LinearToy(), *spec, max_waiting_requests=50).run()
    run = summary(bounded)
    assert bounded.refused == run["failed"] > 0 and run["completed"] == 300 - bounded.refused
    assert run["refused"] == bounded.refused
    # Refused ones are those that arrived while 50 accepted ones had no token yet: never the first 50.
    done = [r for r in bounded.records if r.finish_s is not None]
    assert all(len(r.token_times) == r.output_len for r in done)
    assert all(r.finish_s is not None for r in bounded.records[:50])
    free = ClusterSim(burst, LinearToy(), *spec, max_waiting_requests=None).run()
    assert free.refused == 0 and summary(free)["completed"] == 300


def test_host_shares_its_speed_between_running_steps():
    """Two steps of 10 s alone on a host that halves the speed of each while both run: started
    together they both end at 20 s; started 5 s apart, the first ends at 15 s (5 s alone, 10 s
    shared), the second at 20 s (10 s shared, then 5 s alone)."""
    from tandem.sim.host import Host

    host = Host(lambda k: float(k))
    assert host.start(0, 10.0, 0.0) == {0: 10.0}
    assert host.start(1, 10.0, 0.0) == {0: 20.0, 1: 20.0}
    assert host.finish(0, 20.0) == {1: 20.0}
    assert host.finish(1, 20.0) == {} and host.num_running == 0
    host.start(0, 10.0, 0.0)
    assert host.start(1, 10.0, 5.0) == {0: 15.0, 1: 25.0}
    assert host.finish(0, 15.0) == {1: pytest.approx(20.0)}


def test_step_trace_holds_every_working_step(tmp_path):
    """`record_steps` keeps each instance's steps as the engine's step trace does; written in its
    format, they add up to the trace's work and to the busy time the result reports."""
    from tandem.engine.step_trace import read_step_trace
    from tandem.sim.cli import write_step_trace

    trace = synthetic(60, 20.0, prompt_len=(16, 300), output_len=(4, 40), seed=3)
    sim = ClusterSim(trace, LinearToy(), SPEC, ClusterConfig(num_instances=2), record_steps=True)
    result = sim.run()
    path = tmp_path / "steps.jsonl"
    write_step_trace(sim, str(path))
    lines = read_step_trace(path)
    assert {line["pid"] for line in lines} == {0, 1}
    assert len(lines) == sum(len(inst.steps or []) for inst in sim.instances)
    assert sum(line["prefill_tokens"] for line in lines) == sum(r.prompt_len for r in trace.requests)
    assert sum(line["decode_rows"] for line in lines) == sum(r.output_len - 1 for r in trace.requests)
    busy = sum(f * result.duration_s for f in result.busy_fraction)
    assert sum(line["seconds"] for line in lines) == pytest.approx(busy)
    for inst in sim.instances:
        starts = [s for s, *_ in inst.steps or []]
        assert starts == sorted(starts)


@dataclass
class SlowLink(LinearToy):
    """KV transfers take 20 ms a block: a long context's copy spans many decode steps."""

    def transfer_seconds(self, num_blocks: int) -> float:
        return 0.02 * num_blocks


def test_a_live_move_copies_in_stages_while_the_request_decodes():
    """The moved request keeps decoding while its blocks are copied, stage after stage, and pauses
    only for what is left: its largest gap between tokens is far below what copying its whole
    context would have stopped it for (a stop-and-copy's pause)."""
    # Round robin puts the two long requests on instance 0 and the short one on 1, which ends soon:
    # the imbalance moves the newest long one (a 640-token context: 40 blocks, 0.8 s to copy).
    trace = Trace([TraceRequest(0.0, 600, 400), TraceRequest(0.001, 8, 2), TraceRequest(0.002, 600, 400)])
    sim = ClusterSim(
        trace,
        SlowLink(),
        SPEC,
        ClusterConfig(num_instances=2, dispatch_policy="round_robin", migration_triggers=("imbalance",)),
    )
    result = sim.run()
    (moved,) = [rec for rec in result.records if rec.num_moves]
    assert result.migrations == 1 and moved.prompt_len == 600
    largest = max(b - a for a, b in zip(moved.token_times, moved.token_times[1:]))
    assert largest < 0.25 < SlowLink().transfer_seconds(640 // SPEC.block_size)
