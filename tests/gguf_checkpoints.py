"""GGUF files written from the tiny random-weight checkpoints (tiny_checkpoints.py) with gguf's own
writer, laid out as llama.cpp's converter (convert_hf_to_gguf.py) lays them out: its metadata keys,
Llama's q/k rows permuted for ggml's rope, Gemma's norms stored as 1 + w, experts stacked in one
tensor per projection, rope_freqs for Llama 3 rope. The tensor names come from gguf's name map
(`gguf.get_tensor_name_map`), not from Tandem's loader, so each checks the other.

Weights are quantized with gguf's quantizers where it has them (F16, BF16, Q4_0, Q4_1, Q8_0); it has
none for the K-quants, so Q4_K / Q5_K / Q6_K tensors are random blocks scaled to the weights' spread
(what matters is that transformers and Tandem dequantize the same blocks the same way).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the fp16 super-block scales in each K-quant block (d, and dmin where there is one).
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _set_fp16(data: np.ndarray, offset: int, values: np.ndarray) -> None:
    data[..., offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(*data.shape[:2], 2)


def _qtype(name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[name]


def quantize(values: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """(data, ggml type) for a float32 tensor stored as `kind`."""
    import gguf

    if kind == "F32":
        return values.astype(np.float32), None
    if kind == "F16":
        return values.astype(np.float16), None
    qtype = _qtype(kind)
    if kind not in K_QUANTS:
        return gguf.quants.quantize(values.astype(np.float32), qtype), qtype
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = values.reshape(-1, values.shape[-1])
    data = rng.integers(0, 256, (rows.shape[0], rows.shape[1] // block, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, data.shape[:2]).astype(np.float32)
    _set_fp16(data, 0 if kind != "Q6_K" else 208, d)
    if kind in ("Q4_K", "Q5_K"):
        # Each group's minimum equal to its scale (the 6-bit pairs packed alike) and dmin the middle
        # of q's range times d: weights centred on zero, as real ones are.
        data[..., 8:12] = data[..., 4:8]
        nibble = data[..., 12:16] & np.uint8(0x0F)
        data[..., 12:16] = nibble | (nibble << np.uint8(4))
        _set_fp16(data, 2, d * (7.5 if kind == "Q4_K" else 15.5))
    # Rescale d (and dmin) together so the weights spread as the original ones do.
    spread = float(gguf.quants.dequantize(data.reshape(rows.shape[0], -1), qtype).std()) or 1.0
    factor = float(values.std()) / spread
    for offset in _K_SCALES[kind]:
        raw = np.ascontiguousarray(data[..., offset : offset + 2]).view(np.float16)
        scaled = (raw.astype(np.float32) * factor).astype(np.float16)
        data[..., offset : offset + 2] = scaled.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(*values.shape[:-1], -1), qtype


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(cfg: dict[str, Any], head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for rope_type llama3 (divisors of the
    base frequencies)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    base = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    src: Path,
    out: Path,
    kind: str = "F32",
    embed_kind: str | None = None,
    tokenizer: bool = True,
    seed: int = 0,
    kinds: dict[str, str] | None = None,
) -> Path:
    """`src` (a tiny checkpoint folder) as a GGUF file at `out`: every 2-D weight stored as `kind`
    (the token embedding as `embed_kind`, default `kind`; a weight whose name contains a key of
    `kinds` as its value, as Q4_K_M files keep some in Q6_K), norms and biases in F32."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{model_type}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "phi3":
        w.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: none (llama.cpp's converter)
    rope_type = (cfg.get("rope_scaling") or rope).get("rope_type")
    if tokenizer:
        _add_tokenizer(w, src, cfg)

    tensors = {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    if rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg, head_dim))
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    for hf_name, value in _stacked(tensors, experts).items():
        base, _, leaf = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None:
            raise ValueError(f"gguf has no name for {hf_name} in {arch}")
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            value = llama_permute(value, heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            value = llama_permute(value, kv_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            value = value + 1.0
        if hf_name.endswith("shared_expert_gate.weight"):
            value = value.reshape(-1)  # llama.cpp stores the one-row gate as a vector
        store = kind if value.ndim >= 2 else "F32"
        if base == "model.embed_tokens" and embed_kind is not None:
            store = embed_kind
        store = next((k for part, k in (kinds or {}).items() if part in base and value.ndim >= 2), store)
        data, qtype = quantize(np.ascontiguousarray(value), store, rng)
        w.add_tensor(f"{gguf_base}.{leaf}", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _stacked(tensors: dict[str, np.ndarray], experts: int) -> dict[str, np.ndarray]:
    """Per-expert projections stacked into one [experts, out, in] tensor each, as llama.cpp merges
    them (named by the projection without the expert number)."""
    if not experts:
        return tensors
    out: dict[str, np.ndarray] = {}
    groups: dict[str, list[np.ndarray | None]] = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            merged = ".".join(parts[: i + 1] + parts[i + 2 :])
            groups.setdefault(merged, [None] * experts)[int(parts[i + 1])] = value
        else:
            out[name] = value
    for merged, values in groups.items():
        assert all(v is not None for v in values), merged
        out[merged] = np.stack([v for v in values if v is not None])
    return out


def _add_tokenizer(w: Any, src: Path, cfg: dict[str, Any]) -> None:
    """The folder's byte-level BPE tokenizer as GGUF metadata (tokenizer.ggml.model "gpt2")."""
    import gguf

    tok = json.loads((src / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    specials = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    size = max([*vocab.values(), *specials]) + 1
    tokens = [""] * size
    for text, i in vocab.items():
        tokens[i] = text
    for i, text in specials.items():
        tokens[i] = text
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    template = src / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text())
    else:
        tc = json.loads((src / "tokenizer_config.json").read_text())
        if tc.get("chat_template"):
            w.add_chat_template(tc["chat_template"])
