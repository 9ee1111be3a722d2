"""Token-for-token parity with transformers' greedy generate, across architectures and engine settings."""

from __future__ import annotations

import hf_reference
import pytest
import torch

from tandem import LLM, SamplingParams

MAX_TOKENS = 12
PROMPT_LENS = [1, 2, 7, 16, 33, 64, 150, 310]

ARCHS = {
    "llama": dict(arch="llama"),
    "llama3-rope": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral-window": dict(arch="mistral", sliding_window=48),
    "mistral-linear-rope": dict(arch="mistral", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": dict(arch="qwen2"),
    "qwen3-tied": dict(arch="qwen3", head_dim=32, tie_word_embeddings=True),
}

ENGINES = {
    "default": dict(),
    "block4": dict(block_size=4),
    "chunked": dict(max_num_batched_tokens=16, block_size=8),
    "preempt": dict(block_size=16, num_kv_blocks=24, max_num_batched_tokens=64),
}


def _prompts(tokenizer_dir) -> list[list[int]]:
    from tiny_checkpoints import corpus
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.encode("\n".join(corpus()), add_special_tokens=False)
    out = []
    for i, n in enumerate(PROMPT_LENS):
        start = (i * 997) % (len(ids) - n)
        out.append(ids[start : start + n])
    return out


@pytest.fixture(scope="module")
def prompts(tokenizer_dir) -> list[list[int]]:
    return _prompts(tokenizer_dir)


def hf_greedy(model_dir, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    return hf_reference.hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_parity(model_factory, prompts, arch, engine):
    spec = dict(ARCHS[arch])
    model_dir = model_factory(spec.pop("arch"), **spec)
    expected = hf_greedy(model_dir, prompts)
    llm = LLM(str(model_dir), **ENGINES[engine])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outs) == len(prompts)
    for prompt, out, (ref_ids, ref_lp) in zip(prompts, outs, expected):
        got = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert got.token_ids == ref_ids, f"prompt of {len(prompt)} tokens diverged"
        assert got.finish_reason == "length"
        assert len(got.logprobs) == MAX_TOKENS
        for step, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert entry[tok].rank == 1
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref_lp[step, tid].item()) < 1e-4
    if engine == "preempt":
        assert llm.engine.counters.num_preemptions > 0
        assert any(o.metrics.num_preemptions > 0 for o in outs)
    assert_all_released(llm)


def assert_all_released(llm: LLM) -> None:
    """No request holds a block; whatever is not free is idle in the prefix cache."""
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.usage == 0
    cached = kv.cache.num_cached_blocks if kv.cache else 0
    assert kv.pool.num_free + cached == kv.pool.num_blocks
    if kv.cache:
        assert kv.cache.num_unlocked_blocks == cached


def test_string_prompts_match_hf_tokenization(llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    llm = LLM(str(llama_dir))
    texts = ["def fibonacci(n):", "héllo wörld — 你好", "x"]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for text, out in zip(texts, outs):
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_n_samples_share_prompt_blocks(llama_dir, prompts):
    """n > 1 computes the prompt once; greedy samples are identical to a single greedy run."""
    llm = LLM(str(llama_dir), block_size=4, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": prompts[6]}  # 150 tokens: a partly filled last block (150 % 4 = 2)
    single = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    stats_before = llm.engine.counters.num_batched_tokens
    multi = llm.generate(
        prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    computed = llm.engine.counters.num_batched_tokens - stats_before
    assert [o.index for o in multi[0].outputs] == [0, 1, 2]
    for o in multi[0].outputs:
        assert o.token_ids == single[0].outputs[0].token_ids
    # Prompt once, then 7 decode tokens per sample.
    assert computed == 150 + 3 * 7
    assert_all_released(llm)


def test_chat_uses_template(llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    llm = LLM(str(llama_dir))
    messages = [{"role": "user", "content": "Write a loop."}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
