"""The cluster simulator runs the production scheduling code: every request runs to its length,
every instance ends with its KV pool free (or held only by the idle prefix cache), the same inputs
give the same result, and policies (dispatch, migration, prefill/decode) show in the outcome."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tandem.cluster.config import ClusterConfig
from tandem.sim.cost import StepShape
from tandem.sim.instance import InstanceSpec
from tandem.sim.report import summary
from tandem.sim.simulator import ClusterSim
from tandem.sim.trace import Trace, TraceRequest, synthetic


@dataclass
class LinearToy:
    """A step costs 5 ms plus 0.1 ms per prefill token and 0.2 ms per decode row."""

    name: str = "toy"
    delivery: float = 0.0

    def step_seconds(self, shape: StepShape) -> float:
        return 0.005 + 1e-4 * shape.prefill_tokens + 2e-4 * shape.decode_rows

    def transfer_seconds(self, num_blocks: int) -> float:
        return 0.001 + 1e-5 * num_blocks

    def delivery_seconds(self) -> float:
        return self.delivery


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
    hits = [sum(i.kv.num_hit_tokens for i in s.instances) for s in (rr, pa)]
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
