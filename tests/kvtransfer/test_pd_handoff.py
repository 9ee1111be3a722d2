"""Prefill/decode hand-off between engine cores: the prefill engine computes the prompt (its KV
streamed to the decode engine chunk by chunk as it is computed) and the first token, then the
decode engine goes on. Greedy tokens and logprobs equal the single engine's across prompt lengths,
chunked prefill, prefix hits on either side, n > 1 and speculative decoding; the decode engine
computes only the tokens sampled there (never the prompt: the harness checks every hand-off); a
prefill engine that goes silent is detected by the decode side, which frees what it reserved."""

from __future__ import annotations

import random

import pytest
from cluster_harness import Cluster

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def config(model_dir, **kw) -> EngineConfig:
    base = dict(model=str(model_dir), num_kv_blocks=2048, num_threads=1, block_size=4, max_num_seqs=8)
    base.update(kw)
    return EngineConfig(**base)


def reference(cfg: EngineConfig, prompt: list[int], params: SamplingParams):
    llm = LLM(
        cfg.model,
        num_kv_blocks=cfg.num_kv_blocks,
        num_threads=1,
        block_size=cfg.block_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
    )
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs


def disaggregated(cfg: EngineConfig, tmp_path, cases, warm: list[tuple[list[int], int]] = ()) -> Cluster:
    """Each case prefilled on node 0, decoded on node 1; `warm`: (prompt, node) run to completion
    first (to fill a prefix cache)."""
    cluster = Cluster(cfg, tmp_path)
    try:
        for j, (prompt, node) in enumerate(warm):
            cluster.add(EngineCoreRequest(f"warm{j}", prompt, GREEDY, 2, 0.0), node)
        cluster.settle()
        for i, (prompt, params) in enumerate(cases):
            cluster.add_disaggregated(EngineCoreRequest(f"r{i}", prompt, params, params.max_tokens, 0.0), 0, 1)
        cluster.settle(max_ticks=5000)
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()
    return cluster


def check(cluster: Cluster, cfg: EngineConfig, cases) -> None:
    for i, (prompt, params) in enumerate(cases):
        t = cluster.requests[f"r{i}"]
        assert t.node == 1, f"r{i} was not handed to the decode engine"
        for j, ref in enumerate(reference(cfg, prompt, params)):
            assert t.tokens[j] == list(ref.token_ids), (i, j)
            if params.logprobs is not None:
                got = [lp.logprob for lp in t.logprobs[j]]
                want = [ref.logprobs[k][tok].logprob for k, tok in enumerate(ref.token_ids)]
                assert got == pytest.approx(want, abs=1e-4), (i, j)


@pytest.fixture(scope="module")
def long_dir(model_factory):
    return model_factory("llama", max_position_embeddings=2048)


@pytest.mark.parametrize("length", [1, 7, 64, 600, 2000])
def test_handoff_matches_the_single_engine(long_dir, tmp_path, length):
    cfg = config(long_dir, max_num_batched_tokens=256)
    prompt = [random.Random(length).randrange(3, 500) for _ in range(length)]
    cases = [(prompt, GREEDY)]
    cluster = disaggregated(cfg, tmp_path, cases)
    assert cluster.migrated == 1
    check(cluster, cfg, cases)
    # Chunked (256 tokens a step): a stage went out after each chunk, while the prefill ran on.
    assert cluster.stages == ([length // 256] if length >= 4 else [0]), cluster.stages
    # The decode engine computed no prompt token: it started from the prompt (the first token's
    # KV is its first step's) and computed one token a step, the 11 it sampled.
    steps = cluster.nodes[1].computed["r0"]
    assert steps[0][0] == length and [n for _, n in steps] == [1] * (GREEDY.max_tokens - 1)
    assert sum(n for _, n in cluster.nodes[0].computed["r0"]) == length


def test_handoff_with_n_prefix_hits_and_speculation(llama_dir, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    cfg = config(llama_dir, max_num_batched_tokens=32, speculative_config=spec)
    shared = list(range(100, 160))
    cases = [
        ([*shared, 1, 2, 3], SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True)),
        ([*shared, 7, 8], GREEDY),
        ([*shared[:40], 9], GREEDY),
    ]
    # The shared prefix is cached on both sides beforehand: the prefill engine computes only the
    # rest (and sends every block), the decode engine installs beside its own copy.
    cluster = disaggregated(cfg, tmp_path, cases, warm=[(shared, 0), (shared, 1)])
    assert cluster.migrated == 3
    check(cluster, cfg, cases)


def test_silent_prefill_engine_is_detected(llama_dir, tmp_path):
    cfg = config(llama_dir, kv_transfer_timeout_s=0.3)
    cluster = Cluster(cfg, tmp_path)
    try:
        b = cluster.nodes[1]
        cluster.add_disaggregated(EngineCoreRequest("r0", list(range(3, 40)), GREEDY, 12, 0.0), 0, 1)
        with cluster.holding(0):
            cluster.deliver()
            assert b.plane.active
            cluster.advance(0.35)  # the prefill engine says nothing (hung)
            assert b.plane.tick()
            cluster.deliver()
        assert not b.plane.active and b.core.scheduler.reserved_seats == 0
        assert [d.request_id for d in cluster.dropped] == ["r0"]
        assert b.core.kv.num_available == b.core.kv.num_blocks
    finally:
        cluster.close()


def test_waiting_prefill_keeps_the_reservation_alive(llama_dir, tmp_path):
    # The request waits behind others on the prefill engine longer than the timeout: heartbeats
    # keep the decode side's reservation, and the hand-off still happens.
    cfg = config(llama_dir, kv_transfer_timeout_s=0.6, max_num_seqs=1)
    cluster = Cluster(cfg, tmp_path)
    try:
        cluster.add(EngineCoreRequest("busy", [5, 6, 7], GREEDY, 60, 0.0), 0)
        cluster.add_disaggregated(EngineCoreRequest("r0", [8, 9, 10], GREEDY, 12, 0.0), 0, 1)
        waited = 0.0
        while not cluster.done():
            cluster.advance(0.05)
            waited += 0.05
            cluster.tick()
        assert waited > 2.0  # 60 steps of 0.05 s: the reservation outlived several timeouts
        assert cluster.migrated == 1 and not cluster.dropped
        cluster.settle()
        check(cluster, cfg, [([8, 9, 10], GREEDY)])
    finally:
        cluster.close()
