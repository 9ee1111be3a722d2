"""Mixture-of-experts models: greedy parity with transformers (Qwen3-MoE, Qwen2-MoE, Mixtral), the
grouped expert path against a per-token reference, their checkpoint mapping, and the engine end to
end (chunked prefill, prefix cache, int8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import hf_reference
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig, MoEConfig
from tandem.model.experts import Experts, Int8Experts, route, run_experts
from tandem.model.loader import load_model

MAX_TOKENS = 8
PROMPT_LENS = [1, 3, 17, 40, 90]

MODELS = {
    # top-4 of 8 renormalised (norm_topk_prob), qk-norm, layer 1 dense (mlp_only_layers).
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        head_dim=32,
    ),
    # top-3 of 8 not renormalised, a shared expert with its sigmoid gate, QKV bias, experts only
    # in layer 1 (decoder_sparse_step 2).
    "qwen2_moe": dict(
        arch="qwen2_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    ),
    # top-2 of 6 renormalised, experts intermediate_size wide, a sliding window shorter than prompts.
    "mixtral": dict(
        arch="mixtral", num_local_experts=6, num_experts_per_tok=2, intermediate_size=48, sliding_window=24
    ),
}

# max_num_seqs bounds the row counts the engine warms up at start (a few seconds saved per engine).
ENGINES = {
    "default": dict(max_num_seqs=8),
    # Prompt chunks share steps with other requests' decodes.
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=16, block_size=8),
}
# (chunked prefill with the prefix cache on: test_engine_chunked_prefill_and_prefix_cache)
CASES = [(name, "default") for name in MODELS] + [("mixtral", "chunked")]


@pytest.fixture(scope="module")
def prompts(tokenizer_dir) -> list[list[int]]:
    from tiny_checkpoints import corpus
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tokenizer_dir)).encode(
        "\n".join(corpus()), add_special_tokens=False
    )
    return [ids[i * 301 : i * 301 + n] for i, n in enumerate(PROMPT_LENS)]


def moe_dir(model_factory, name: str) -> Path:
    spec = dict(MODELS[name])
    return model_factory(spec.pop("arch"), **spec)


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    return hf_reference.hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "engine"), CASES)
def test_greedy_parity(model_factory, prompts, name, engine):
    """All prompts in one generate call, so a step's experts see tokens of several requests."""
    model_dir = moe_dir(model_factory, name)
    expected = hf_greedy(model_dir, prompts)
    llm = LLM(str(model_dir), **ENGINES[engine])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf_reference.assert_matches(prompts, outs, expected, f"{name}: ")


def test_layers_follow_the_sparse_settings(model_factory):
    from tandem.model.moe import SparseMoeBlock

    for name, sparse in {"qwen3_moe": [0, 2], "qwen2_moe": [1], "mixtral": [0, 1]}.items():
        model = load_model(
            ModelConfig.from_pretrained(moe_dir(model_factory, name)),
            torch.float32,
            torch.device("cpu"),
            "torch",
            64,
        )
        layers = model.layers  # type: ignore[attr-defined]
        assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)] == sparse
    cfg = ModelConfig.from_pretrained(moe_dir(model_factory, "qwen2_moe"))
    assert cfg.moe is not None and cfg.moe.shared_expert_intermediate_size == 48
    assert cfg.attention_bias and not cfg.qk_norm and cfg.sliding_window is None
    cfg = ModelConfig.from_pretrained(moe_dir(model_factory, "mixtral"))
    assert cfg.moe is not None and cfg.moe.norm_topk_prob and cfg.sliding_window == 24


# The grouped expert path against a per-token reference.


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> Experts:
    g = torch.Generator().manual_seed(seed)
    experts = Experts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(num_experts, hidden, inter, generator=g) * 0.3)
    return experts.requires_grad_(False)


def _reference(gate_up: torch.Tensor, down: torch.Tensor, x, ids, weights) -> torch.Tensor:
    """Token by token, expert by expert, written from the definition."""
    inter = down.shape[2]
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate_up[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, k]) * (down[e].double() @ act)
    return out


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 40),
    num_experts=st.integers(1, 12),
    top_k_frac=st.floats(0.0, 1.0),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_experts_match_per_token_reference(tokens, num_experts, top_k_frac, norm, seed):
    top_k = 1 + int(top_k_frac * (num_experts - 1))
    hidden, inter = 16, 8
    experts = _experts(num_experts, hidden, inter, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g)
    moe = MoEConfig(num_experts, top_k, inter, norm, float32_routing_weights=True)
    weights, ids = route(torch.randn(tokens, num_experts, generator=g), moe)
    assert ids.shape == (tokens, top_k)
    got = run_experts(experts, x, ids, weights)
    assert got.shape == (tokens, hidden) and got.dtype == torch.float32
    ref = _reference(experts.gate_up_proj, experts.down_proj, x, ids, weights)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


def test_routing_is_softmax_then_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, MoEConfig(4, 2, 8, norm_topk_prob=False, float32_routing_weights=True))
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = route(logits, MoEConfig(4, 2, 8, norm_topk_prob=True, float32_routing_weights=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    bf16, _ = route(logits.bfloat16(), MoEConfig(4, 2, 8, norm_topk_prob=True, float32_routing_weights=False))
    assert bf16.dtype == torch.bfloat16


@pytest.mark.parametrize("tokens", [1, 2, 23])
def test_int8_experts_match_their_dequantized_weights(tokens):
    experts = _experts(6, 32, 16, seed=3)
    q = Int8Experts(experts, use_kernel=False)
    gate_up = torch.stack([m.dequantized(torch.float32) for m in q.gate_up])
    down = torch.stack([m.dequantized(torch.float32) for m in q.down])
    assert gate_up.shape == experts.gate_up_proj.shape
    # int8 with one scale per output row: within half a step of the float weights.
    step = experts.gate_up_proj.abs().amax(dim=2, keepdim=True) / 127
    assert bool(((gate_up - experts.gate_up_proj).abs() <= step / 2 + 1e-7).all())
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, 32, generator=g)
    weights, ids = route(torch.randn(tokens, 6, generator=g), MoEConfig(6, 2, 16, True, True))
    ref = _reference(gate_up, down, x, ids, weights)
    torch.testing.assert_close(q(x, ids, weights).double(), ref, atol=1e-4, rtol=1e-4)


# Checkpoint mapping.


def _rewrite(src: Path, dst: Path, drop: str | None = None, rename: tuple[str, str] | None = None) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop is not None:
        del tensors[drop]
    if rename is not None:
        tensors[rename[1]] = tensors.pop(rename[0])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(folder: Path):
    return load_model(ModelConfig.from_pretrained(folder), torch.float32, torch.device("cpu"), "torch", 64)


def test_experts_are_stacked_from_the_checkpoint(model_factory):
    for name, prefix, (gate, up, down) in [
        ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
        ("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    ]:
        folder = moe_dir(model_factory, name)
        ref = load_file(str(folder / "model.safetensors"))
        experts = _load(folder).layers[0].mlp.experts  # type: ignore[attr-defined]
        inter = experts.intermediate_size
        for e in (0, experts.num_experts - 1):
            key = f"model.layers.0.{prefix}.experts.{e}"
            assert torch.equal(experts.gate_up_proj[e, :inter], ref[f"{key}.{gate}.weight"])
            assert torch.equal(experts.gate_up_proj[e, inter:], ref[f"{key}.{up}.weight"])
            assert torch.equal(experts.down_proj[e], ref[f"{key}.{down}.weight"])


def test_a_missing_expert_tensor_is_named(model_factory, tmp_path):
    folder = _rewrite(
        moe_dir(model_factory, "qwen3_moe"),
        tmp_path / "m",
        drop="model.layers.2.mlp.experts.5.up_proj.weight",
    )
    with pytest.raises(
        ValueError, match=r"missing tensors: layers\.2\.mlp\.experts\.gate_up_proj\[5\]\[32, 64\]"
    ):
        _load(folder)


def test_an_expert_beyond_the_config_is_refused(model_factory, tmp_path):
    name = "model.layers.0.mlp.experts.7.down_proj.weight"
    folder = _rewrite(
        moe_dir(model_factory, "qwen3_moe"), tmp_path / "m", rename=(name, name.replace(".7.", ".8."))
    )
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.8\.down_proj"):
        _load(folder)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(use_sliding_window=True, sliding_window=32), "use_sliding_window"),  # some layers only
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),  # more than the 8 experts
    ],
)
def test_bad_moe_configs_are_refused(model_factory, tmp_path, change, field):
    folder = tmp_path / "m"
    shutil.copytree(moe_dir(model_factory, "qwen2_moe"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_pretrained(folder)


# The engine end to end.


@pytest.mark.slow
def test_engine_chunked_prefill_and_prefix_cache(model_factory, prompts):
    """Prompts sharing a long prefix, through chunked prefill: the second round hits the prefix
    cache and gives the same greedy tokens as transformers, as the first round did."""
    model_dir = moe_dir(model_factory, "qwen2_moe")
    base = prompts[4][:64]
    shared = [base + p[:n] for p, n in zip(prompts, (1, 3, 9))]
    expected = [ids for ids, _ in hf_greedy(model_dir, shared)]
    llm = LLM(
        str(model_dir), max_num_seqs=8, max_num_batched_tokens=32, block_size=8, enable_prefix_caching=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    for round_ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in shared], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"round {round_}"
    assert llm.get_stats()["prefix_cache_hits"] >= 3 * 64
    assert all(o.metrics is not None and o.metrics.num_cached_tokens >= 64 for o in outs)
    assert llm.engine.kv.usage == 0


@pytest.mark.slow
def test_engine_int8_experts(model_factory, prompts):
    model_dir = moe_dir(model_factory, "mixtral")
    llm = LLM(str(model_dir), max_num_seqs=8, quantization="int8")
    block = llm.engine.core.runner.model.layers[0].mlp  # type: ignore[attr-defined]
    assert isinstance(block.experts, Int8Experts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
    expected = hf_greedy(model_dir, prompts)
    for out, (_, ref_lp) in zip(outs, expected):
        got = out.outputs[0]
        assert len(got.token_ids) == MAX_TOKENS
        # int8 weights move the logprobs a little; the first token's stays close to float's.
        first = got.token_ids[0]
        assert abs(got.logprobs[0][first].logprob - ref_lp[0, first].item()) < 0.1


@pytest.mark.slow
def test_engine_speculation_keeps_greedy_output(model_factory, prompts):
    """n-gram speculation verifies several tokens per request in one pass through the experts."""
    model_dir = moe_dir(model_factory, "qwen3_moe")
    expected = [ids for ids, _ in hf_greedy(model_dir, prompts)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(model_dir), max_num_seqs=8, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
