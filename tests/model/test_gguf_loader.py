"""GGUF files of every architecture Tandem runs, written from random-weight checkpoints
(tests/gguf_checkpoints.py: llama.cpp's layout, gguf's writer and name map) in each tensor type,
loaded by Tandem and by transformers (`from_pretrained(dir, gguf_file=...)`, which dequantizes with
the same gguf reader): with dtype float32 every tensor is dequantized and greedy decoding is the
same token for token, logprobs within 1e-4. With dtype auto the 4-bit blocks stay packed
(Int4Linear) and hold exactly the dequantized weights. Mixtral and Llama 3's rope_freqs, which
transformers' GGUF reader does not handle, are checked against the checkpoints they were written
from."""

from __future__ import annotations

import hf_reference
import pytest
import torch
from gguf_checkpoints import write_gguf

from tandem import LLM, SamplingParams
from tandem.model.int4 import Int4Linear

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
LENGTHS = [3, 17, 40]
ENGINE = dict(max_model_len=128, kv_cache_memory=32 << 20)
# K-quants need rows of 256 (their super-blocks); Qwen3's GGUF config in transformers takes its
# default head_dim (128) and Gemma's its default attention scale (256 = head_dim here).
WIDE = dict(hidden_size=256, intermediate_size=512)
QWEN3 = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)
GEMMA = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256)

# name -> (architecture, tensor type, checkpoint overrides). Untied heads unless the architecture's
# GGUF has no output tensor (Gemma): a tied random model mostly repeats its input.
CASES = {
    "llama-F32": ("llama", "F32", {}),
    "llama-F16": ("llama", "F16", {}),
    "llama-BF16": ("llama", "BF16", {}),
    "llama-Q8_0": ("llama", "Q8_0", {}),
    "llama-Q4_0": ("llama", "Q4_0", {}),
    "llama-Q4_K": ("llama", "Q4_K", WIDE),
    "llama-Q6_K": ("llama", "Q6_K", WIDE),
    "qwen2-Q4_1": ("qwen2", "Q4_1", {}),
    "qwen2-Q5_K": ("qwen2", "Q5_K", WIDE),
    "qwen3-Q8_0": ("qwen3", "Q8_0", QWEN3),
    "gemma2-Q4_0": ("gemma2", "Q4_0", dict(GEMMA, tie_word_embeddings=True)),
    "gemma3-Q4_1": ("gemma3", "Q4_1", dict(GEMMA, tie_word_embeddings=True)),
    "phi3-Q8_0": ("phi3", "Q8_0", dict(pad_token_id=0)),
    "qwen2_moe-Q8_0": (
        "qwen2_moe",
        "Q8_0",
        # transformers' GGUF config takes its defaults for the expert widths: these are they.
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
        ),
    ),
    "qwen3_moe-Q4_0": (
        "qwen3_moe",
        "Q4_0",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, head_dim=16),
    ),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]


def hf_gguf_greedy(folder, file_name: str, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """transformers reading the GGUF file: greedy ids and per-step log-softmax (EOS masked)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=file_name, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        out.append(
            (g.sequences[0, len(p) :].tolist(), torch.log_softmax(torch.stack(g.logits, 1)[0].float(), -1))
        )
    return out


def _generate(llm: LLM, prompts: list[list[int]]):
    # min_tokens masks EOS as the reference's min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=2)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("case", CASES)
def test_gguf_matches_transformers_reading_the_same_file(model_factory, tmp_path, case):
    arch, kind, overrides = CASES[case]
    src = model_factory(arch, **{"tie_word_embeddings": False, **overrides})
    gguf_file = write_gguf(src, tmp_path / f"{case}.gguf", kind)
    prompts = _prompts()
    expected = hf_gguf_greedy(tmp_path, gguf_file.name, prompts)
    llm = LLM(str(gguf_file), dtype="float32", **ENGINE)
    assert llm.engine.config.quantization is None  # an explicit dtype: every tensor dequantized
    outs = _generate(llm, prompts)
    hf_reference.assert_matches(prompts, outs, expected, label=f"{case}: ")
    # The outputs depend on the prompt (a model that says one token whatever it reads would hide errors).
    assert len({tuple(out.outputs[0].token_ids) for out in outs}) == len(prompts)


@pytest.mark.parametrize("case", ["llama-Q4_0", "qwen2-Q4_1", "llama-Q4_K", "gemma3-Q4_1", "qwen3_moe-Q4_0"])
def test_packed_layers_hold_the_dequantized_weights(model_factory, tmp_path, case):
    arch, kind, overrides = CASES[case]
    src = model_factory(arch, **{"tie_word_embeddings": False, **overrides})
    gguf_file = write_gguf(src, tmp_path / f"{case}.gguf", kind)
    packed = LLM(str(gguf_file), **ENGINE)  # dtype auto: the blocks stay packed
    dense = LLM(str(gguf_file), dtype="float32", **ENGINE)
    assert packed.engine.config.quantization == "gguf"
    p_model = packed.engine.core.runner.model
    d_model = dense.engine.core.runner.model
    layers = 0
    for name, p_mod in p_model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            assert isinstance(p_mod, Int4Linear), name
            # x = I runs the float layer through its weight exactly: the packed layer's weight.
            eye = torch.eye(p_mod.in_features)
            assert torch.equal(p_mod.dequantized(torch.float32).T, d_model.get_submodule(name)(eye)), name
            layers += 1
    # Every projection the float model has (MoE experts are stacked tensors: dequantized).
    suffixes = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert layers == sum(name.endswith(suffixes) for name, _ in d_model.named_modules())
    assert layers >= 2 * len(p_model.layers)
    # Outputs agree with the dequantized model's within the packed kernel's activation rounding: the
    # 3-token prompt's pass has int8 activation blocks; without AMX the panel kernel runs every
    # prompt's pass with them, 40 tokens of these random models' sharp distributions (measured up
    # to 0.40 on a token of log-probability -3.4; on the trained default model the prompt path's
    # perplexity moved by 0.01%, docs/quantized_checkpoints.md).
    panels = any(isinstance(m, Int4Linear) and m.panels is not None for m in p_model.modules())
    tol = 0.5 if panels else 0.1
    prompts = _prompts()
    for a, b in zip(_generate(packed, prompts), _generate(dense, prompts)):
        first = a.outputs[0].logprobs[0]
        ref = b.outputs[0].logprobs[0]
        common = set(first) & set(ref)
        diffs = {t: abs(first[t].logprob - ref[t].logprob) for t in common}
        assert common and max(diffs.values()) < tol, diffs


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
        (
            "llama",
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            ),
        ),
    ],
    ids=["mixtral", "llama3-rope-freqs"],
)
def test_gguf_matches_the_checkpoint_it_was_written_from(model_factory, tmp_path, arch, overrides):
    src = model_factory(arch, tie_word_embeddings=False, **overrides)
    gguf_file = write_gguf(src, tmp_path / f"{arch}.gguf", "F32")
    prompts = _prompts()
    expected = hf_reference.hf_greedy(src, prompts, MAX_TOKENS)
    outs = _generate(LLM(str(gguf_file), dtype="float32", **ENGINE), prompts)
    hf_reference.assert_matches(prompts, outs, expected, label=f"{arch}: ")


def test_a_layer_with_a_part_of_another_type_is_dequantized_whole(model_factory, tmp_path, caplog):
    """As in Q4_K_M files: v in Q6_K beside q and k in Q4_K. The fused q/k/v projection is then float;
    the other projections stay packed; the start-up line says so."""
    import logging

    src = model_factory("llama", tie_word_embeddings=False, **WIDE)
    gguf_file = write_gguf(src, tmp_path / "mixed.gguf", "Q4_K", kinds={"v_proj": "Q6_K"})
    with caplog.at_level(logging.INFO, logger="tandem.model.loader"):
        llm = LLM(str(gguf_file), **ENGINE)
    layer = llm.engine.core.runner.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, Int4Linear)
    assert isinstance(layer.self_attn.o_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF mixed.gguf"))
    assert "fused layers mix 4-bit and other types and are dequantized (e.g. layers.0.self_attn.qkv_proj" in line
    assert "Q6_K" in line
