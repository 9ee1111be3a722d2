"""Greedy parity, token for token, with transformers for Gemma 2, Gemma 3, Phi-3 and the rope
variants (yarn, dynamic, longrope, partial rotary), each on batched requests of different lengths,
whole and in chunked prefill."""

from __future__ import annotations

import hf_reference
import pytest
import torch
from test_parity import assert_all_released

from tandem import LLM, SamplingParams

MAX_TOKENS = 12
LONG = [1, 7, 33, 150]

GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
}
PHI3_ROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.3, 2.0, 3.5],
    "long_factor": [1.5, 3.0, 7.0, 20.0],
}
PHI3 = dict(
    arch="phi3",
    head_dim=16,
    pad_token_id=0,
    partial_rotary_factor=0.5,
    max_position_embeddings=1024,
    original_max_position_embeddings=48,
    sliding_window=40,
    rope_scaling=PHI3_ROPE,
)

# name -> (checkpoint, prompt lengths, engine arguments). Untied heads: a tied random model mostly
# repeats its input token, which would hide attention errors.
CASES = {
    # Soft-capped attention and logits (caps small enough to bend the values), its own attention
    # scale, windowed layers with a window shorter than most prompts.
    "gemma2": (
        dict(
            arch="gemma2",
            head_dim=16,
            sliding_window=12,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=2.0,
            query_pre_attn_scalar=24,
            tie_word_embeddings=False,
        ),
        LONG,
        {},
    ),
    # q/k norms, local layers with their own rope base and a small window, linear-scaled global rope.
    "gemma3": (
        dict(
            arch="gemma3",
            head_dim=16,
            sliding_window=10,
            query_pre_attn_scalar=24,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=GEMMA3_ROPE,
        ),
        LONG,
        {},
    ),
    # Sequences within the original length: longrope's short factors.
    "phi3-longrope-short": (PHI3, [1, 7, 16, 36], dict(max_model_len=48)),
    # Past it: the long factors, for prompts longer than the original length.
    "phi3-longrope-long": (PHI3, [49, 64, 150], {}),
    "llama-yarn": (
        dict(arch="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        LONG,
        {},
    ),
    # Prompts within max_position_embeddings, decodes past it (where the base grows).
    "llama-dynamic": (
        dict(arch="llama", max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        [1, 7, 33, 60, 64],
        dict(max_model_len=128),
    ),
}

ENGINES = {"default": {}, "chunked": dict(max_num_batched_tokens=16, block_size=8)}
# Chunked prefill changes how attention is grouped (context gathered from the cache), which the
# per-layer windows and soft-caps go through; rope tables are per position, whatever the chunking.
RUNS = [(case, "default") for case in CASES] + [("gemma2", "chunked"), ("gemma3", "chunked")]


def _prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir, prompts: list[list[int]], fresh: bool) -> list[tuple[list[int], torch.Tensor]]:
    return hf_reference.hf_greedy(model_dir, prompts, MAX_TOKENS, fresh)


@pytest.mark.parametrize(("case", "engine"), RUNS)
def test_greedy_parity(model_factory, case, engine):
    spec, lengths, engine_args = CASES[case]
    spec = dict(spec)
    model_dir = model_factory(spec.pop("arch"), **spec)
    prompts = _prompts(lengths)
    expected = hf_greedy(model_dir, prompts, fresh="dynamic" in case)
    llm = LLM(str(model_dir), **engine_args, **ENGINES[engine])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf_reference.assert_matches(prompts, outs, expected)
    # The outputs depend on the context (a model that repeats one token would hide errors).
    assert len({t for out in outs for t in out.outputs[0].token_ids}) > MAX_TOKENS
    assert_all_released(llm)
