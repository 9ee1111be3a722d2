"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' log-softmax of the prompt
positions: plain, chunked prefill, a prefix-cache hit, preemption, n > 1, mixed batches."""

from __future__ import annotations

import pytest
import torch
from test_parity import _prompts, assert_all_released

from tandem import LLM, SamplingParams

TOP_K = 3
TOL = 1e-4

_HF: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
_MODELS: dict[str, torch.nn.Module] = {}


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row j is the log-softmax that predicts prompt token j + 1."""
    key = (str(model_dir), tuple(prompt))
    if key not in _HF:
        from transformers import AutoModelForCausalLM

        if str(model_dir) not in _MODELS:
            _MODELS[str(model_dir)] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        model = _MODELS[str(model_dir)]
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        _HF[key] = torch.log_softmax(logits, dim=-1)[:-1]
    return _HF[key]


def check(model_dir, prompt: list[int], got, k: int = TOP_K) -> None:
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for j in range(1, len(prompt)):
        entry, row, token = got[j], ref[j - 1], prompt[j]
        assert token in entry, f"position {j}: the prompt token is missing"
        assert abs(entry[token].logprob - row[token].item()) < TOL, f"position {j}"
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = {tid: lp for tid, lp in entry.items() if lp.rank <= k}
        assert set(top) == set(row.topk(k).indices.tolist())
        assert len(entry) == k + (token not in top)
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < TOL


@pytest.fixture(scope="module")
def prompts(tokenizer_dir) -> list[list[int]]:
    return _prompts(tokenizer_dir)


ENGINES = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=16, block_size=8),
    "preempt": dict(block_size=16, num_kv_blocks=24, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_prompt_logprobs_match_transformers(llama_dir, prompts, engine):
    llm = LLM(str(llama_dir), num_threads=1, **ENGINES[engine])
    max_tokens = 16 if engine == "preempt" else 4  # long enough outputs to run out of blocks
    want = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=TOP_K)
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Every other prompt asks: rows that do not ask get none and share the batch. Under preemption
    # all ask, so that prompts recomputed after preemption are checked for repeats and holes.
    asks = [engine == "preempt" or i % 2 == 0 for i in range(len(prompts))]
    params = [want if a else plain for a in asks]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, p, out in zip(asks, prompts, outs):
        if a:
            check(llama_dir, p, out.prompt_logprobs)
        else:
            assert out.prompt_logprobs is None
    if engine == "preempt":
        assert any(o.metrics.num_preemptions > 0 for o in outs)
    assert_all_released(llm)


def test_prefix_cache_hit_still_gives_every_position(llama_dir, prompts):
    llm = LLM(str(llama_dir), num_threads=1, block_size=4, max_num_batched_tokens=32)
    prompt = prompts[6]  # 150 tokens
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt[:120]}, plain, use_tqdm=False)
    hit = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens == 120  # the prefix is cached...
    want = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP_K)
    out = llm.generate({"prompt_token_ids": prompt}, want, use_tqdm=False)[0]
    check(llama_dir, prompt, out.prompt_logprobs)  # ...yet every position has its logprob
    assert out.metrics.num_cached_tokens == 0
    assert out.outputs[0].token_ids == hit.outputs[0].token_ids
    assert_all_released(llm)


def test_n_samples_and_zero_top(llama_dir, prompts):
    llm = LLM(str(llama_dir), num_threads=1, block_size=4)
    prompt = prompts[3]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, prompt_logprobs=0, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check(llama_dir, prompt, out.prompt_logprobs, k=0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert_all_released(llm)


def test_one_token_prompt_and_validation(llama_dir):
    llm = LLM(str(llama_dir), num_threads=1)
    out = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert out[0].prompt_logprobs == [None]
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
