"""Prefill/decode disaggregation behind the real front end: one prefill and one decode engine
process. Every request is prefilled on the first and decoded on the second (short prompts, under
the threshold, wholly on the second), with the single engine's greedy tokens; killing the prefill
engine mid-transfer, killing the decode engine mid-decode, or losing hand-overs in the connector
(fault injection) costs no request, and no engine is left holding blocks."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys

import pytest

from tandem import LLM, SamplingParams
from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.config import EngineConfig
from tandem.engine.connection import ProcessConnection
from tandem.engine.core_client import AsyncEngineClient, Disaggregation

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# Hand-overs ("handover" messages) the connector drops, in the engine processes, when told to.
SITECUSTOMIZE = """
import os
if os.environ.get("TANDEM_TEST_DROP_HANDOVERS"):
    import tandem.kvtransfer.transport as t

    original = t.KVTransport.send

    def send(self, peer, header, payload=None):
        if b"handover" in header[:40]:
            return  # lost on the way
        return original(self, peer, header, payload)

    t.KVTransport.send = send
"""


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.choice([3, 40, 150, 400]))] for _ in range(n)]


async def serve(config: EngineConfig, batch: list[list[int]], min_prompt: int = 0, kill: str | None = None):
    stats: dict[int, object] = {}
    conns = [ProcessConnection(config), ProcessConnection(config)]
    cluster = ClusterConfig(num_instances=2, prefill_instances=1, decode_instances=1)
    client = AsyncEngineClient(
        config,
        on_stats=lambda i, s: stats.__setitem__(i, s),
        connections=conns,
        make_dispatcher=lambda readies: Dispatcher(cluster, [r.limits.num_blocks for r in readies], 4),
        disaggregation=Disaggregation(frozenset({0}), frozenset({1}), min_prompt),
    )
    await client.start(timeout=300)
    try:
        assert client.inputs is not None
        streams = []
        for i, prompt in enumerate(batch):
            req, text = client.inputs.process(f"r{i}", {"prompt_token_ids": prompt}, PARAMS)
            streams.append(client.add(req, text, asyncio.Event()))
        if kill == "prefill":
            # At the first hand-over the 400-token prompts are still prefilling (64 tokens a step),
            # whatever the machine's speed: a fixed sleep let them all finish on a fast one.
            while client.num_live_migrations < 1:
                await asyncio.sleep(0.002)
            os.kill(conns[0].pid, signal.SIGKILL)
        elif kill == "decode":
            while client.num_live_migrations < 2:
                await asyncio.sleep(0.005)
            os.kill(conns[1].pid, signal.SIGKILL)
        finals: dict[int, list[int]] = {}
        while len(finals) < len(streams):
            await asyncio.sleep(0.01)
            for i, stream in enumerate(streams):
                out = stream.take()
                if out is not None and out.finished:
                    finals[i] = list(out.outputs[0].token_ids)
        assert client.streams == {} and client.moves == {}
        survivors = [i for i in (0, 1) if i in client.live]
        for _ in range(200):
            if all(i in stats and stats[i].num_running == 0 and stats[i].kv_usage == 0.0 for i in survivors):
                break
            await asyncio.sleep(0.05)
        return finals, client, {i: stats[i] for i in survivors}
    finally:
        await client.shutdown()


def check(llama_dir, batch, finals) -> None:
    offline = LLM(str(llama_dir), num_kv_blocks=512, num_threads=1, block_size=4)
    for i, prompt in enumerate(batch):
        expected = offline.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0]
        assert finals[i] == list(expected.outputs[0].token_ids), i


def config(llama_dir, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(llama_dir),
        num_kv_blocks=512,
        num_threads=1,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        **kw,
    )


def test_prefilled_on_one_decoded_on_the_other(llama_dir):
    batch = prompts(6)
    finals, client, stats = asyncio.run(serve(config(llama_dir), batch, min_prompt=10))
    check(llama_dir, batch, finals)
    short = sum(len(p) < 10 for p in batch)
    assert client.num_live_migrations == len(batch) - short and client.num_pd_fallbacks == 0
    assert all(s.num_running == 0 and s.kv_usage == 0.0 for s in stats.values()), stats


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_an_engine_killed_mid_flight_costs_no_request(llama_dir, victim):
    batch = prompts(5, seed=1)
    finals, client, stats = asyncio.run(serve(config(llama_dir), batch, kill=victim))
    check(llama_dir, batch, finals)
    assert client.num_resumed >= 1
    assert all(s.num_running == 0 and s.kv_usage == 0.0 for s in stats.values()), stats


def test_lost_hand_overs_fall_back_to_the_decode_engine(llama_dir, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setenv("TANDEM_TEST_DROP_HANDOVERS", "1")
    batch = prompts(3, seed=2)
    finals, client, stats = asyncio.run(serve(config(llama_dir, kv_transfer_timeout_s=1.0), batch))
    check(llama_dir, batch, finals)
    assert client.num_pd_fallbacks == len(batch) and client.num_live_migrations == 0
    assert all(s.num_running == 0 and s.kv_usage == 0.0 for s in stats.values()), stats
