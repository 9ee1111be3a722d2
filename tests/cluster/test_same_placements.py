"""The simulator and the server's front end place requests with the same code: one trace runs
through the cluster simulator, and what its front end saw (arrivals, load reports, completed
hand-offs, finishes, in order) is replayed through the real `AsyncEngineClient` over recording
connections; every request lands on the same instance, and every hand-off goes to the same decode
instance, in both. Torch-free: no engine, the client's messages decoded where they would leave."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from tandem.cluster.build import build_cluster
from tandem.cluster.config import ClusterConfig
from tandem.core.engine_io import EngineCoreRequest, SampleOutput
from tandem.engine import messages as m
from tandem.engine.core_client import AsyncEngineClient
from tandem.engine.processor import OutputProcessor
from tandem.engine.tokenizer import Tokenizer
from tandem.kvtransfer.protocol import MoveOutcome
from tandem.sim.cost import FrontEndCpu, StepShape
from tandem.sim.instance import InstanceSpec
from tandem.sim.simulator import ClusterSim
from tandem.sim.trace import synthetic

SPEC = InstanceSpec(
    num_blocks=2048, block_size=16, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096
)


@dataclass
class Toy:
    """A step costs 5 ms plus 0.1 ms per prefill token and 0.2 ms per decode row."""

    name: str = "toy"

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        return 0.005 + 1e-4 * shape.prefill_tokens + 2e-4 * shape.decode_rows

    def transfer_seconds(self, num_blocks: int) -> float:
        return 0.001 + 1e-5 * num_blocks

    def delivery_seconds(self) -> float:
        return 0.002

    def ingress_seconds(self) -> float:
        return 0.001

    def loop_gap_seconds(self) -> float:
        return 0.0

    def co_run_slowdown(self, running: int) -> float:
        return 1.0

    def front_end_cpu(self) -> FrontEndCpu:
        return FrontEndCpu()


class RecordedSim(ClusterSim):
    """The simulator, its front end's events written down as they happen."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.log: list[tuple] = []
        observe = self.dispatcher.observe

        def recorded_observe(instance: int, stats: m.Stats) -> None:
            self.log.append(("report", instance, stats))
            observe(instance, stats)

        self.dispatcher.observe = recorded_observe  # type: ignore[method-assign]

    def _place(self, req: EngineCoreRequest) -> tuple[int, int | None]:
        placed = super()._place(req)
        self.log.append(("add", req, placed))
        return placed

    def _outcome(self, rid: str, move: Any, outcome: MoveOutcome) -> None:
        self.log.append(("migrated", rid, move.source, move.transfer_id, outcome))
        super()._outcome(rid, move, outcome)

    def _forget(self, rid: str) -> None:
        self.log.append(("finish", rid))
        super()._forget(rid)


class Recording:
    """A connection that keeps what the client sent, decoded."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self._dec = m.engine_decoder()

    def send(self, payload: bytes) -> None:
        self.sent.append(self._dec.decode(payload))


def replay(log: list[tuple], cluster: ClusterConfig, tokenizer_dir: Any) -> tuple[AsyncEngineClient, list]:
    """The simulator's front-end events through the real client; its placements, as sent."""
    n = cluster.num_instances
    conns = [Recording() for _ in range(n)]
    parts = build_cluster(cluster, None, [SPEC.num_blocks] * n, SPEC.block_size)  # type: ignore[arg-type]
    c = AsyncEngineClient(config=None, connections=conns, disaggregation=parts.roles)  # type: ignore[arg-type]
    c.dispatcher = parts.dispatcher
    c.instances.live = set(range(n))
    c.instances.kv_addresses = [f"ipc://kv{i}" for i in range(n)]
    c.outputs = OutputProcessor(Tokenizer(str(tokenizer_dir)))
    placed = []
    for event in log:
        kind = event[0]
        if kind == "add":
            req = event[1]
            c.add(req, None, asyncio.Event())
            sends = [(i, msg) for i, conn in enumerate(conns) for msg in conn.sent]
            for conn in conns:
                conn.sent.clear()
            (where,) = [i for i, msg in sends if isinstance(msg, m.Add)]
            handoffs = [msg.peer for _, msg in sends if isinstance(msg, m.MigrateOut)]
            handoff = int(handoffs[0].removeprefix("ipc://kv")) if handoffs else None
            placed.append((req.request_id, where, handoff))
        elif kind == "report":
            c._handle(event[1], m.Outputs([], event[2]))
        elif kind == "migrated":
            _, rid, source, transfer_id, outcome = event
            c._handle(source, m.Migrated(rid, transfer_id, outcome))
        elif kind == "finish":
            rid = event[1]
            run = c.router.table.runs[rid]
            done = SampleOutput(rid, 0, [7], None, finish_reason="length", incarnation=run)
            c._handle(c.routes[rid], m.Outputs([done]))
            assert rid not in c.streams and rid not in c.routes
    return c, placed


@pytest.mark.parametrize(
    "cluster",
    [
        ClusterConfig(num_instances=3, prefill_instances=1, decode_instances=2, pd_min_prompt_tokens=200),
        ClusterConfig(num_instances=3, dispatch_policy="least_load"),
        ClusterConfig(num_instances=4, dispatch_policy="prefix_aware"),
        ClusterConfig(num_instances=3, dispatch_policy="round_robin"),
    ],
    ids=["pd", "least_load", "prefix_aware", "round_robin"],
)
def test_the_simulator_and_the_front_end_place_a_trace_alike(cluster, tokenizer_dir):
    trace = synthetic(
        120,
        50.0,
        burstiness=0.5,
        prompt_len=(96, 700),
        output_len=(4, 120),
        seed=5,
        num_prefix_groups=6,
        prefix_len=96,
    )
    sim = RecordedSim(trace, Toy(), SPEC, cluster)
    result = sim.run()
    assert result.migrations_aborted == 0  # a refused hand-off ends differently: the server recomputes it
    expected = [(e[1].request_id, *e[2]) for e in sim.log if e[0] == "add"]
    client, placed = replay(sim.log, cluster, tokenizer_dir)
    assert placed == expected
    assert len(placed) == 120 and len({where for _, where, _ in placed}) == cluster.num_instances
    if cluster.disaggregated:
        handed = [p for p in placed if p[2] is not None]
        assert result.handoffs == len(handed) > 10
        assert {where for _, where, _ in handed} == {0} and {h for *_, h in handed} == {1, 2}
    assert client.streams == {} and client.moves == {}
    assert [v.demand for v in client.dispatcher.instances] == [v.demand for v in sim.dispatcher.instances]
