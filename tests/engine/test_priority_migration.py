"""The priority trigger end to end: a high-priority request waiting on a full instance makes room by
moving a lower-priority running request, live, to an instance with a free seat. The real front end
(AsyncEngineClient with a Dispatcher), the real migration policy (Migrator, Rebalancer) and two
engine processes; no Ray. The test runs the migrator's round itself, so the move happens when the
test says, and the low-priority request decodes 1000 tokens, so it is still running when it moves
on any machine."""

from __future__ import annotations

import asyncio

import pytest

from tandem import LLM, SamplingParams
from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.cluster.migrator import Migrator
from tandem.config import EngineConfig
from tandem.engine.connection import ProcessConnection
from tandem.engine.core_client import AsyncEngineClient
from tandem.kvtransfer.protocol import MoveOutcome, MoveReport

pytestmark = pytest.mark.slow

LOW = ([5, 9, 11, 13, 17], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
HIGH = ([21, 22, 23], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))


async def serve(config: EngineConfig) -> tuple[dict[str, list[int]], list[MoveReport], dict, dict]:
    cluster = ClusterConfig(num_instances=2, migration_triggers=("priority",))
    stats: dict[int, object] = {}
    steps: dict[int, list[int]] = {0: [], 1: []}  # tokens computed per engine step, per instance

    def on_stats(i: int, s) -> None:
        stats[i] = s
        for n, times in s.counters.iteration_tokens.items():
            steps[i] += [n] * times

    reports: list[MoveReport] = []
    client = AsyncEngineClient(
        config,
        on_stats=on_stats,
        connections=[ProcessConnection(config), ProcessConnection(config)],
        make_dispatcher=lambda readies: Dispatcher(cluster, [r.limits.num_blocks for r in readies], 4),
        on_migrated=reports.append,
    )
    await client.start(timeout=300)
    try:
        assert client.inputs is not None
        migrator = Migrator(
            cluster, client, client.dispatcher
        )  # its rounds run when the test says (not started)
        req, text = client.inputs.process("low", {"prompt_token_ids": LOW[0]}, LOW[1], priority=0)
        low = client.add(req, text, asyncio.Event(), instance=0)
        while not low.started:
            await asyncio.sleep(0.005)
        # The high-priority request lands on instance 0, whose one seat the low one holds: it waits.
        req, text = client.inputs.process("high", {"prompt_token_ids": HIGH[0]}, HIGH[1], priority=-1)
        high = client.add(req, text, asyncio.Event(), instance=0)
        assert migrator.round() == 1
        assert client.moves["low"].destination == 1 and not client.moves["low"].after_prefill
        assert migrator.rebalancer.num_planned["priority"] == 1
        finals: dict[str, list[int]] = {}
        while len(finals) < 2:
            await asyncio.sleep(0.01)
            for name, stream in (("low", low), ("high", high)):
                out = stream.take()
                if out is not None and out.finished:
                    finals[name] = list(out.outputs[0].token_ids)
        for _ in range(200):  # the last reports (every step's token count) in
            if all(i in stats and stats[i].num_running == 0 for i in (0, 1)):
                break
            await asyncio.sleep(0.05)
        return finals, reports, steps, dict(stats)
    finally:
        await client.shutdown()


def test_a_waiting_high_priority_request_makes_room_by_moving_a_lower_one(llama_dir):
    config = EngineConfig(
        model=str(llama_dir), num_kv_blocks=512, num_threads=1, block_size=4, max_num_seqs=1
    )
    finals, reports, steps, stats = asyncio.run(serve(config))
    (report,) = reports
    assert report.request_id == "low" and report.outcome is MoveOutcome.COMPLETED
    assert report.downtime_s is not None and report.num_bytes > 0
    offline = LLM(str(llama_dir), num_kv_blocks=512, num_threads=1, block_size=4)
    for name, (prompt, params) in (("low", LOW), ("high", HIGH)):
        expected = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert finals[name] == list(expected.outputs[0].token_ids), name
    # Instance 1 took the low request over with its KV: no prompt came to it and every step there
    # computed one token (a fallback to recompute would have computed the whole context at once).
    assert stats[1].counters.prompt_tokens == 0
    assert steps[1] and all(n == 1 for n in steps[1]), steps[1][:10]
    assert 0 < stats[1].counters.generation_tokens < LOW[1].max_tokens
    # The high-priority request ran where it had landed, once the seat was free.
    assert stats[0].counters.prompt_tokens == len(LOW[0]) + len(HIGH[0])
