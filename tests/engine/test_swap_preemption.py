"""Preemption by swap through the engine, on a tiny checkpoint: greedy tokens equal a run that never
preempts, and a swapped request is not computed again (the engine's computed-token count is exactly
what the outputs need, so a silent fallback to recompute fails); the runner's host copies round-trip
a block's raw rows in every KV cache format."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, ModelConfig
from tandem.core.preemption import model_flops
from tandem.engine.core import preemption_cost, swap_space_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(5 + 7 * i, 45 + 7 * i)) for i in range(5)]


def run(model_dir, prompts: list[list[int]] = PROMPTS, **kw) -> tuple[list[list[int]], dict]:
    kw.setdefault("enable_prefix_caching", False)
    llm = LLM(str(model_dir), block_size=4, num_threads=1, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.get_stats()


# Each request's prompt, then its outputs but the last, computed once.
NEEDED = sum(len(p) + GREEDY.max_tokens - 1 for p in PROMPTS)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_preemption_keeps_tokens_and_computes_nothing_again(llama_dir, kv_cache_dtype) -> None:
    reference, ref_stats = run(llama_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256)
    assert ref_stats["num_preemptions"] == 0 and ref_stats["num_batched_tokens"] == NEEDED
    # 24 blocks of 4 tokens for five requests of 64 tokens each: preemption on every round.
    tight = {"kv_cache_dtype": kv_cache_dtype, "num_kv_blocks": 24, "max_num_batched_tokens": 64}
    swapped, stats = run(llama_dir, swap_space=0.01, preemption_mode="swap", **tight)
    assert swapped == reference
    assert stats["num_swap_outs"] > 0 and stats["num_recompute_preemptions"] == 0
    assert stats["num_swap_ins"] == stats["num_swap_outs"] == stats["num_preemptions"]
    assert stats["swap_out_bytes"] == stats["swap_in_bytes"] > 0
    assert stats["num_batched_tokens"] == NEEDED, "a swapped request was computed again"
    # The same run by recompute computes the victims' tokens again.
    recomputed, stats = run(llama_dir, swap_space=0, **tight)
    assert recomputed == reference
    assert stats["num_recompute_preemptions"] == stats["num_preemptions"] > 0 and stats["num_swap_outs"] == 0
    assert stats["num_batched_tokens"] > NEEDED


def test_swap_with_prefix_caching(llama_dir) -> None:
    """Prompts sharing a cached prefix: a swapped request keeps the shared blocks on the device and
    swaps its own; every token not found in the cache is computed once."""
    shared = list(range(300, 324))
    prompts = [[*shared, *range(400 + 9 * i, 412 + 9 * i)] for i in range(4)]
    needed = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    reference, _ = run(llama_dir, prompts, num_kv_blocks=256)
    tight = {"num_kv_blocks": 30, "max_num_batched_tokens": 64, "enable_prefix_caching": True}
    swapped, stats = run(llama_dir, prompts, swap_space=0.01, preemption_mode="swap", **tight)
    assert swapped == reference
    assert stats["num_swap_outs"] == stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_batched_tokens"] == needed - stats["prefix_cache_hits"]


def test_the_cost_model_decides_in_the_engine(llama_dir) -> None:
    """Under `auto` the constants decide: a fast host link swaps every victim, a slow one none."""
    tight = {"num_kv_blocks": 24, "max_num_batched_tokens": 64, "swap_space": 0.01}
    _, fast = run(llama_dir, swap_bandwidth_gbps=1e6, recompute_tflops=1e-3, **tight)
    assert fast["num_swap_outs"] == fast["num_preemptions"] > 0
    _, slow = run(llama_dir, swap_bandwidth_gbps=1e-6, recompute_tflops=1e3, **tight)
    assert slow["num_recompute_preemptions"] == slow["num_preemptions"] > 0 and slow["num_swap_outs"] == 0


def test_engine_arguments_size_the_swap_space_and_the_cost_model(llama_dir) -> None:
    mc = ModelConfig.from_pretrained(llama_dir)
    assert swap_space_bytes(EngineConfig(model="x"), "cpu") == 0  # a CPU's KV is in host memory already
    assert swap_space_bytes(EngineConfig(model="x"), "cuda") == 4 << 30  # vLLM's default
    assert swap_space_bytes(EngineConfig(model="x", swap_space=0.5), "cpu") == 1 << 29
    cost = preemption_cost(
        EngineConfig(model="x", swap_bandwidth_gbps=2.0, recompute_tflops=3.0), mc, 100, "cpu"
    )
    assert (cost.link_bytes_per_s, cost.flops_per_s, cost.block_bytes) == (2e9, 3e12, 100)
    assert (cost.linear_flops_per_token, cost.attention_flops_per_pair) == model_flops(mc)
    llm = LLM(str(llama_dir), num_kv_blocks=16, swap_space=0.001)
    runner, kv = llm.engine.core.runner, llm.engine.core.kv
    assert kv.num_swap_blocks == (1 << 30) // 1000 // runner.swap_block_bytes()
    assert runner.swap_space is not None and runner.swap_space[0].shape[0] == kv.num_swap_blocks
    assert LLM(str(llama_dir), num_kv_blocks=16).engine.core.kv.swap_pool is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_the_runner_round_trips_raw_blocks(llama_dir, kv_cache_dtype) -> None:
    """Blocks copied out to host memory and back into other blocks hold the same bytes (a quantized
    row's scale included) in every layer, and the blocks around them are untouched."""
    llm = LLM(str(llama_dir), num_kv_blocks=16, swap_space=0.001, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.core.runner
    gen = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        raw = cache.view(torch.uint8)
        raw.copy_(torch.randint(0, 255, raw.shape, generator=gen, dtype=torch.uint8))
    before = [c.clone() for c in runner.kv_caches]
    runner.swap_out([(3, 0), (7, 2)])
    for cache in runner.kv_caches:
        cache[:, [3, 7]] = 0  # as if handed to other requests and overwritten
    runner.swap_in([(0, 11), (2, 5)])
    for b, a in zip(before, runner.kv_caches):
        assert torch.equal(a[:, 11].view(torch.uint8), b[:, 3].view(torch.uint8))
        assert torch.equal(a[:, 5].view(torch.uint8), b[:, 7].view(torch.uint8))
        untouched = [i for i in range(a.shape[1]) if i not in (3, 5, 7, 11)]
        assert torch.equal(a[:, untouched].view(torch.uint8), b[:, untouched].view(torch.uint8))


def test_swap_counters_cross_to_prometheus() -> None:
    """The scheduler's swap counters travel in the engine's report and come out as `tandem:` metrics."""
    from tandem.core.stats import EngineCounters
    from tandem.engine import messages as m
    from tandem.entrypoints.openai.metrics import ServerMetrics
    from tandem.loadgen.server_counters import parse_prometheus

    counters = EngineCounters(
        num_preemptions=5,
        num_recompute_preemptions=2,
        num_swap_outs=3,
        num_swap_ins=2,
        swap_out_bytes=3 << 20,
        swap_in_bytes=2 << 20,
    )
    (outputs,) = [m.client_decoder().decode(m.encoder().encode(m.Outputs([], m.Stats(0, 0, 0.0, counters))))]
    metrics = ServerMetrics("tiny")
    metrics.observe_stats(outputs.stats)
    exposed = parse_prometheus(metrics.render()[0].decode())
    for name, value in [
        ("num_preemptions_total", 5),
        ("num_recompute_preemptions_total", 2),
        ("num_swap_outs_total", 3),
        ("num_swap_ins_total", 2),
        ("swap_out_bytes_total", 3 << 20),
        ("swap_in_bytes_total", 2 << 20),
    ]:
        assert exposed[f"tandem:{name}"] == value, name
