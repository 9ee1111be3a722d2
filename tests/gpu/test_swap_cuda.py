"""On a CUDA GPU only (marked `gpu`, skipped elsewhere): preemption by swap copies KV blocks to pinned
host memory and back (CUDA graphs on), giving the tokens of a run that never preempts, with no token
computed twice; the same checks run on CPU in tests/engine/test_swap_preemption.py."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(5 + 7 * i, 45 + 7 * i)) for i in range(5)]
NEEDED = sum(len(p) + GREEDY.max_tokens - 1 for p in PROMPTS)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_swap_to_pinned_memory_keeps_greedy_tokens(llama_dir, kv_cache_dtype) -> None:
    common = dict(device="cuda", block_size=16, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    runs = []
    for extra in (dict(num_kv_blocks=64), dict(num_kv_blocks=7, swap_space=0.01, preemption_mode="swap")):
        llm = LLM(str(llama_dir), **common, **extra)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        runs.append(([list(o.outputs[0].token_ids) for o in outs], llm.get_stats(), llm.engine.core.runner))
    (reference, _, _), (swapped, stats, runner) = runs
    assert swapped == reference
    assert runner.swap_space is not None and all(t.is_pinned() for t in runner.swap_space)
    assert stats["num_swap_outs"] == stats["num_swap_ins"] == stats["num_preemptions"] > 0
    assert stats["num_batched_tokens"] == NEEDED
