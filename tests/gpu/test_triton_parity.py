"""The GPU path's model code on CPU: the engine with the `triton` attention backend (its kernel under
the Triton interpreter) against transformers' greedy generate, token for token, across
architectures (grouped-query heads, sliding windows, Gemma's soft-capping and per-layer windows)
and engine settings (small blocks, chunked prefill over cached prefixes, preemption, prefix
caching, speculative decoding's verification)."""

from __future__ import annotations

import os

import hf_reference
import pytest

from tandem import LLM, SamplingParams

pytest.importorskip("triton")

# TANDEM_TEST_DEVICE=cuda runs the same comparisons on a GPU (benchmarks/gpu/check.sh).
DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
# On a GPU each engine takes a small cache (not 90% of the GPU): several live in one test process.
GPU_KV = {"kv_cache_memory": 64 << 20} if DEVICE == "cuda" else {}

MAX_TOKENS = 8
PROMPT_LENS = [1, 7, 33, 70]

ARCHS = {
    "llama": dict(arch="llama"),
    "mistral-window": dict(arch="mistral", sliding_window=24),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "gemma2": dict(arch="gemma2"),
    "gemma3": dict(arch="gemma3"),
}

ENGINES = {
    "default": dict(),
    "block4-chunked": dict(block_size=4, max_num_batched_tokens=16),
    "preempt": dict(block_size=16, num_kv_blocks=12, max_num_batched_tokens=64),
    "ngram": dict(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    ),
    "eager": dict(enforce_eager=True),
}


def prompts_of(tokenizer_dir) -> list[list[int]]:
    from tiny_checkpoints import corpus
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tokenizer_dir)).encode(
        "\n".join(corpus()), add_special_tokens=False
    )
    return [ids[(i * 991) % (len(ids) - n) :][:n] for i, n in enumerate(PROMPT_LENS)]


@pytest.mark.parametrize(
    "arch, engine",
    [(a, "default") for a in ARCHS] + [("llama", e) for e in ENGINES if e != "default"],
)
def test_greedy_parity_with_the_triton_backend(model_factory, tokenizer_dir, arch, engine):
    spec = dict(ARCHS[arch])
    model_dir = model_factory(spec.pop("arch"), **spec)
    prompts = prompts_of(tokenizer_dir)
    expected = hf_reference.hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(
        str(model_dir),
        attention_backend="triton",
        dtype="float32",
        device=DEVICE,
        **{**GPU_KV, **ENGINES[engine]},
    )
    runner = llm.engine.core.runner
    assert runner.backend.name == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, (ref_ids, _) in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == ref_ids, (
            f"{arch}/{engine}: prompt of {len(prompt)} tokens diverged"
        )
    if engine == "default":  # the decode steps went through the static buffers (graphs on CUDA)
        assert runner.graphs is not None and runner.graphs.steps > 0


def test_a_cached_prefix_is_read_through_the_kernel(model_factory):
    """Two requests sharing a long prefix: the second's prompt starts from cached blocks (a chunk
    with context), and its output equals a run without the cache."""
    model_dir = model_factory("llama")
    shared = list(range(5, 69))
    prompts = [[*shared, 70, 71], [*shared, 72, 73, 74]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cached = LLM(
        str(model_dir), attention_backend="triton", dtype="float32", device=DEVICE, block_size=16, **GPU_KV
    )
    first = cached.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    second = cached.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    assert cached.get_stats()["prefix_cache_hits"] > 0
    plain = LLM(
        str(model_dir),
        attention_backend="triton",
        dtype="float32",
        device=DEVICE,
        enable_prefix_caching=False,
        **GPU_KV,
    )
    ref = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [first[0].outputs[0].token_ids, second[0].outputs[0].token_ids] == [
        r.outputs[0].token_ids for r in ref
    ]


def test_draft_trees_verify_through_the_kernel(model_factory):
    """Suffix speculation's trees over motifs that repeat with different continuations: the
    kernel's tree mask gives the tokens a run without speculation gives."""
    model_dir = model_factory("llama", initializer_range=0.05)
    motif = [11, 12, 13]
    prompts = [[*motif, 20 + i, *motif, 30 + i, *motif] for i in range(3)]
    spec = {
        "method": "suffix",
        "num_speculative_tokens": 6,
        "suffix_decoding_min_token_prob": 0.0,
        "suffix_decoding_max_spec_factor": 4.0,
        "adaptive": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(str(model_dir), dtype="float32", device="cpu").generate(
        [{"prompt_token_ids": p} for p in prompts], params
    )
    llm = LLM(
        str(model_dir),
        attention_backend="triton",
        dtype="float32",
        device=DEVICE,
        speculative_config=spec,
        **GPU_KV,
    )
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.counters.spec_decode_num_draft_tokens > 0
