"""Live migration between engine cores: staged KV copy, stop-and-copy, hand-over. Requests moved at
exact points (mid-prefill, after the first token, mid-decode; with n > 1, prefix-cache hits,
speculative decoding) produce the single engine's greedy tokens, each once, and leave no block,
seat or reservation behind on either side."""

from __future__ import annotations

import random

import pytest

from cluster_harness import Cluster
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.messages import EngineCoreRequest

PROMPTS = [list(range(5, 5 + 37)), [21, 22, 23], list(range(30, 30 + 21)), [40, 41, 42, 43, 44]]


def config(model_dir, **kw) -> EngineConfig:
    base = dict(model=str(model_dir), num_kv_blocks=96, num_threads=1, block_size=4, max_num_seqs=8)
    base.update(kw)
    return EngineConfig(**base)


def reference(cfg: EngineConfig, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    llm = LLM(
        cfg.model,
        num_kv_blocks=cfg.num_kv_blocks,
        num_threads=1,
        block_size=cfg.block_size,
        speculative_config=cfg.speculative_config,
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return [list(c.token_ids) for c in out.outputs]


def run(cfg: EngineConfig, tmp_path, cases, moves) -> Cluster:
    """`cases`: (prompt, params); `moves`: tick -> list of (request index, destination)."""
    cluster = Cluster(cfg, tmp_path)
    try:
        for i, (prompt, params) in enumerate(cases):
            cluster.add(EngineCoreRequest(f"r{i}", prompt, params, params.max_tokens, 0.0), 0)
        tick = 0
        while not cluster.done():
            for i, dest in moves.get(tick, []):
                cluster.migrate(f"r{i}", dest)
            cluster.tick()
            tick += 1
            assert tick < 3000
        cluster.settle()
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()
    return cluster


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("tick", [0, 2, 6, 12])
def test_one_migration_at_each_point(llama_dir, tmp_path, tick):
    # The 37-token prompt takes five 8-token steps, the short one is admitted in the fifth. Tick 0:
    # both wait (nothing computed: they are resumed there instead); 2: the long one mid-prefill;
    # 6: the short one right after its first token; 12: both mid-decode.
    cfg = config(llama_dir, max_num_batched_tokens=8)
    cases = [(PROMPTS[0], GREEDY), (PROMPTS[1], GREEDY)]
    cluster = run(cfg, tmp_path, cases, {tick: [(0, 1), (1, 1)]})
    assert cluster.migrated + cluster.recomputed == 2, cluster.abandoned
    assert cluster.migrated == {0: 0, 2: 1, 6: 2, 12: 2}[tick]
    for i, (prompt, params) in enumerate(cases):
        assert [cluster.requests[f"r{i}"].tokens[j] for j in range(params.n)] == reference(cfg, prompt, params)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=0.0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=1.0, min_tokens=30),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
    ],
    ids=["n3", "penalties", "seeded"],
)
def test_back_and_forth(llama_dir, tmp_path, params):
    cfg = config(llama_dir, max_num_seqs=16, num_kv_blocks=160)
    rng = random.Random(0)
    moves = {t: [(i, rng.randrange(2)) for i in range(len(PROMPTS))] for t in range(0, 60, 5)}
    cases = [(p, params) for p in PROMPTS]
    cluster = run(cfg, tmp_path, cases, moves)
    assert cluster.migrated >= 8, cluster.abandoned
    for i, (prompt, p) in enumerate(cases):
        assert [cluster.requests[f"r{i}"].tokens[j] for j in range(p.n)] == reference(cfg, prompt, p), i


def test_with_prefix_cache_hits_and_speculation(llama_dir, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    cfg = config(llama_dir, speculative_config=spec)
    shared = PROMPTS[0][:24]
    cases = [(shared + [7, 8], GREEDY), (shared + [9], GREEDY), (shared + [7, 8, 9, 10], GREEDY)]
    moves = {2: [(0, 1)], 6: [(1, 1), (2, 1)], 14: [(0, 0)], 20: [(2, 0)]}
    cluster = run(cfg, tmp_path, cases, moves)
    assert cluster.migrated >= 4, cluster.abandoned
    for i, (prompt, p) in enumerate(cases):
        assert cluster.requests[f"r{i}"].tokens[0] == reference(cfg, prompt, p)[0], i
