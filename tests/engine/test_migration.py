"""Moving running requests between instances, live (the KV cache copied in stages, then a short
pause) or by recompute (the source aborts, the destination resumes from the tokens produced so
far), at random moments and many times over: every stream gets exactly the single engine's greedy
tokens, each once, and both instances end with no request and no KV held. Two engine processes
behind one front end; no Ray needed."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys

import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.connection import ProcessConnection
from tandem.engine.core_client import AsyncEngineClient

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 11, 13, 17], [21, 22, 23], [30, 31, 32, 33, 34, 35], [40, 41], [50, 52, 54, 56]]
CASES = [
    SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, presence_penalty=1.0),
    SamplingParams(n=2, temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, min_tokens=30),
    SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, repetition_penalty=1.2),
]


# Moves the test wants; the streams run in rounds until that many have happened, so a fast engine
# (streams ending between two moves) takes more rounds, never fewer moves.
MIN_MOVES = 10
MAX_ROUNDS = 20


async def run(config: EngineConfig, seed: int, live: bool) -> tuple[list[dict[int, list[list[int]]]], int, dict]:
    stats: dict[int, object] = {}
    client = AsyncEngineClient(
        config,
        on_stats=lambda i, s: stats.__setitem__(i, s),
        connections=[ProcessConnection(config), ProcessConnection(config)],
    )
    await client.start(timeout=300)
    try:
        assert client.inputs is not None
        rng = random.Random(seed)
        rounds: list[dict[int, list[list[int]]]] = []

        def moved() -> int:
            return client.num_live_migrations if live else client.num_migrated

        while moved() < MIN_MOVES and len(rounds) < MAX_ROUNDS:
            streams = []
            for i, (prompt, params) in enumerate(zip(PROMPTS, CASES)):
                req, text = client.inputs.process(f"r{len(rounds)}-{i}", {"prompt_token_ids": prompt}, params)
                streams.append(client.add(req, text, asyncio.Event(), instance=i % 2))
            finals: dict[int, list[list[int]]] = {}
            while len(finals) < len(streams):
                await asyncio.sleep(rng.uniform(0.0005, 0.008))
                for i, stream in enumerate(streams):
                    rid = f"r{len(rounds)}-{i}"
                    if rid in client.routes and rng.random() < 0.4:
                        move = client.migrate_live if live else client.migrate_by_recompute
                        move(rid, 1 - client.routes[rid])
                    out = stream.take()
                    if out is not None and out.finished:
                        finals[i] = [list(c.token_ids) for c in out.outputs]
            rounds.append(finals)
        assert client.streams == {} and client.routes == {} and client.requests == {} and client.moves == {}
        # Both instances report nothing running and no block held.
        for _ in range(200):
            if len(stats) == 2 and all(s.num_running == 0 and s.kv_usage == 0.0 for s in stats.values()):
                break
            await asyncio.sleep(0.05)
        return rounds, moved(), dict(stats)
    finally:
        await client.shutdown()


@pytest.mark.parametrize(("seed", "live"), [(0, True), (1, True), (0, False)])
def test_migrating_at_random_moments_changes_no_token(llama_dir, seed, live):
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=128, num_threads=1, block_size=4, max_num_seqs=8)
    rounds, migrated, stats = asyncio.run(run(config, seed, live))
    assert migrated >= MIN_MOVES, (migrated, len(rounds))
    assert all(s.num_running == 0 and s.kv_usage == 0.0 for s in stats.values()), stats
    offline = LLM(str(llama_dir), num_kv_blocks=128, num_threads=1, block_size=4)
    for i, (prompt, params) in enumerate(zip(PROMPTS, CASES)):
        expected = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        for finals in rounds:
            assert finals[i] == [list(c.token_ids) for c in expected.outputs], i


async def kill_during_moves(config: EngineConfig, victim: int, delay: float) -> tuple[dict, dict]:
    """Three requests on instance 0 move live to instance 1; `delay` seconds later the `victim`
    instance is SIGKILLed. Returns each request's tokens and the survivor's last stats."""
    stats: dict[int, object] = {}
    conns = [ProcessConnection(config), ProcessConnection(config)]
    client = AsyncEngineClient(config, on_stats=lambda i, s: stats.__setitem__(i, s), connections=conns)
    await client.start(timeout=300)
    try:
        assert client.inputs is not None
        streams = []
        for i, (prompt, params) in enumerate(zip(PROMPTS[:3], CASES[:3])):
            req, text = client.inputs.process(f"r{i}", {"prompt_token_ids": prompt}, params)
            streams.append(client.add(req, text, asyncio.Event(), instance=0))
        while not all(s.started for s in streams):
            await asyncio.sleep(0.005)
        for i in range(3):
            assert client.migrate_live(f"r{i}", 1)
        await asyncio.sleep(delay)
        os.kill(conns[victim].pid, signal.SIGKILL)
        finals: dict[int, list[list[int]]] = {}
        while len(finals) < 3:
            await asyncio.sleep(0.01)
            for i, stream in enumerate(streams):
                out = stream.take()
                if out is not None and out.finished:
                    finals[i] = [list(c.token_ids) for c in out.outputs]
        assert client.streams == {} and client.moves == {}
        survivor = 1 - victim
        for _ in range(200):
            s = stats.get(survivor)
            if s is not None and s.num_running == 0 and s.kv_usage == 0.0:
                break
            await asyncio.sleep(0.05)
        return finals, stats[survivor]
    finally:
        await client.shutdown()


@pytest.mark.parametrize(("victim", "delay"), [(1, 0.0), (1, 0.03), (0, 0.0), (0, 0.03)])
def test_instance_killed_mid_migration(llama_dir, victim, delay):
    # Destination killed: the requests stay on (or come back to) the source. Source killed: they
    # are resumed on the destination (recompute), whatever it had received is dropped.
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=128, num_threads=1, block_size=4, max_num_seqs=8)
    finals, survivor = asyncio.run(kill_during_moves(config, victim, delay))
    assert survivor.num_running == 0 and survivor.kv_usage == 0.0
    offline = LLM(str(llama_dir), num_kv_blocks=128, num_threads=1, block_size=4)
    for i, (prompt, params) in enumerate(zip(PROMPTS[:3], CASES[:3])):
        expected = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert finals[i] == [list(c.token_ids) for c in expected.outputs], i


# The first engine process to schedule a prompt starting with HANG_PREFIX stops answering (a step
# that never ends); any other engine runs it normally.
HANG_PREFIX = [9, 9, 9, 9, 4]
SITECUSTOMIZE = """
import os, time
if os.environ.get("TANDEM_TEST_HANG_MARKER"):
    import tandem.engine.core as core

    original = core.EngineCore.step

    def step(self):
        for r in self.scheduler.running + self.scheduler.waiting:
            if r.prompt_token_ids[:5] == [9, 9, 9, 9, 4]:
                try:
                    os.close(os.open(os.environ["TANDEM_TEST_HANG_MARKER"], os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    break
                time.sleep(3600)
        return original(self)

    core.EngineCore.step = step
"""


async def hang_one(config: EngineConfig) -> tuple[list[int], AsyncEngineClient]:
    client = AsyncEngineClient(
        config, connections=[ProcessConnection(config), ProcessConnection(config)], hang_timeout_s=3.0
    )
    await client.start(timeout=300)
    try:
        assert client.inputs is not None
        req, text = client.inputs.process("h", {"prompt_token_ids": HANG_PREFIX}, CASES[0])
        stream = client.add(req, text, asyncio.Event(), instance=0)
        while not stream.finished:
            await asyncio.sleep(0.05)
        out = stream.take()
        assert out is not None
        return list(out.outputs[0].token_ids), client
    finally:
        await client.shutdown()


def test_a_hung_instance_is_detected_and_its_requests_move_on(llama_dir, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setenv("TANDEM_TEST_HANG_MARKER", str(tmp_path / "hung"))
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=128, num_threads=1, block_size=4, max_num_seqs=8)
    tokens, client = asyncio.run(hang_one(config))
    assert (tmp_path / "hung").exists() and client.num_resumed == 1 and client.live == {1}
    assert client.connections[0].exit_reason() is not None  # the hung process was stopped
    expected = LLM(str(llama_dir), num_kv_blocks=128, num_threads=1, block_size=4).generate(
        {"prompt_token_ids": HANG_PREFIX}, CASES[0], use_tqdm=False
    )[0]
    assert tokens == list(expected.outputs[0].token_ids)
