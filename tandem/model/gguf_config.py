"""A GGUF file's metadata as the Hugging Face config.json and generation_config.json Tandem reads.

The file is read with ggml's own reader (the `gguf` package); no torch here. llama.cpp's converter
(convert_hf_to_gguf.py) writes each architecture's hyperparameters under `{arch}.*` keys and its
rope scaling partly as tensors; this module writes them back as transformers names them, so that
`ModelConfig.from_pretrained` reads a GGUF model exactly as it reads a checkpoint folder. Where the
file leaves something out, the values are llama.cpp's own (its src/models/*.cpp), since llama.cpp
is what the file was made for:

- Gemma 2 / 3: the attention scale is 1/sqrt(hidden / heads) for the 27B models (46 and 62 layers)
  and 1/sqrt(head_dim) otherwise; Gemma 3's pattern of sliding layers is 6 unless the file says.
- Llama 3.x stores its rope frequencies' divisors as the tensor `rope_freqs`, Phi-3 its long and
  short factors as `rope_factors_long` / `rope_factors_short`: both become a `longrope` config with
  those factors (for Llama, the same set at every length and no attention factor, as llama.cpp
  applies them).
- MoE: llama.cpp normalises the top-k routing weights of Qwen3-MoE and Mixtral and not those of
  Qwen2-MoE, unless the file has `{arch}.expert_weights_norm`.
- The end-of-generation tokens are the file's EOS, EOT and EOM ids plus the end-of-turn markers
  llama.cpp recognises by their text (END_OF_TURN_TOKENS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# general.architecture -> (config.json `architectures` entry, `model_type`). A "llama" file with
# experts is Mixtral (llama.cpp converts Mixtral to its llama architecture).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")
# Token texts llama.cpp ends generation at (llama-vocab.cpp), whatever the file's EOS id is.
END_OF_TURN_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<|end_of_text|>", "<EOT>",
)  # fmt: skip
# Layers of the 27B Gemma models, whose attention scale llama.cpp takes from hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# general.sampling.* -> generation_config.json's names (what `--generation-config auto` reads).
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class GGUFConfig:
    """What a GGUF file says about its model: config.json and generation_config.json contents."""

    architecture: str  # general.architecture
    name: str | None  # general.name
    config: dict[str, Any]
    generation_config: dict[str, Any]
    has_tokenizer: bool  # tokenizer.ggml.* is there (else the tokenizer must be given)


def open_reader(path: str | Path) -> Any:
    """A `gguf.GGUFReader` over the file (memory-mapped), or a ValueError saying why not."""
    import gguf

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"GGUF file {str(file)!r} does not exist")
    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, OSError, KeyError, IndexError) as exc:  # bad magic, truncated, unknown types
        raise ValueError(f"cannot read {str(file)!r} as a GGUF file: {exc}") from exc
    count = field(reader, "split.count")
    if count is not None and int(count) > 1:
        raise ValueError(
            f"{file.name} is part of a split GGUF ({count} files): merge them first "
            "(llama.cpp's `llama-gguf-split --merge FIRST OUT`)"
        )
    return reader


def field(reader: Any, key: str) -> Any:
    """A metadata value as Python (str, int, float, bool, or a list of them); None when absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def gguf_config(reader: Any) -> GGUFConfig:
    arch = field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError("the GGUF file has no general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    hf = _architecture(reader, arch)

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = field(reader, f"{arch}.{name}")
        if value is None:
            if required:
                raise ValueError(f"the GGUF file has no {arch}.{name}")
            return default
        return value

    def scalar(name: str, default: Any = None, required: bool = False) -> Any:
        value = key(name, default, required)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{arch}.{name} differs between layers ({value}): not supported")
            value = value[0]
        return value

    if "token_embd.weight" not in tensors:
        raise ValueError("the GGUF file has no token_embd.weight tensor")
    hidden = int(scalar("embedding_length", required=True))
    heads = int(scalar("attention.head_count", required=True))
    head_dim = int(scalar("attention.key_length", hidden // heads))
    value_dim = int(scalar("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"{arch}: key length {head_dim} and value length {value_dim} differ: not supported")
    layers = int(scalar("block_count", required=True))
    cfg: dict[str, Any] = {
        "architectures": [hf[0]],
        "model_type": hf[1],
        # The embedding's rows: the vocabulary the weights were trained with (tensor dims are
        # reversed in GGUF: [hidden, vocab]).
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(scalar("feed_forward_length", required=True)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(scalar("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(scalar("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(scalar("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        "rope_theta": float(scalar("rope.freq_base", 10000.0)),
        "torch_dtype": "float32",
    }
    rope_dim = scalar("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dim) / head_dim
    window = scalar("attention.sliding_window")
    rope_scaling = _rope_scaling(reader, arch, tensors, cfg)
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if hf[0] in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        cfg.update(_moe(reader, arch, hf[0], layers, tensors))
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma(reader, arch, layers, hidden, heads, head_dim, window))
    elif window:  # 0 marks "no window" (Phi-4 in the phi3 architecture)
        cfg["use_sliding_window"] = True
        cfg["sliding_window"] = int(window)
    eos = end_of_generation_ids(reader)
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    cfg["bos_token_id"] = None if bos is None else int(bos)
    cfg["eos_token_id"] = eos
    gen: dict[str, Any] = {"eos_token_id": eos}
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    for gguf_key, name in _SAMPLING_KEYS.items():
        value = field(reader, gguf_key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            gen[name] = value
    return GGUFConfig(
        architecture=arch,
        name=field(reader, "general.name"),
        config=cfg,
        generation_config=gen,
        has_tokenizer=field(reader, "tokenizer.ggml.model") is not None,
    )


def _architecture(reader: Any, arch: str) -> tuple[str, str]:
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    if arch == "llama" and int(field(reader, "llama.expert_count") or 0) > 0:
        return MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def tensor_values(reader: Any, name: str) -> list[float]:
    """A small float tensor's values (rope factors), dequantized by ggml's reader."""
    from gguf import dequantize

    tensor = next(t for t in reader.tensors if t.name == name)
    return [float(v) for v in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]


def _rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], cfg: dict[str, Any]
) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensors:
        freqs = tensor_values(reader, "rope_freqs.weight")
        return {
            "rope_type": "longrope",
            "short_factor": freqs,
            "long_factor": freqs,
            "factor": 1.0,
            "attention_factor": 1.0,
            "original_max_position_embeddings": cfg["max_position_embeddings"],
        }
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors:
        attn = field(reader, f"{arch}.rope.scaling.attn_factor")
        out: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": tensor_values(reader, "rope_factors_long.weight"),
            "short_factor": tensor_values(
                reader,
                "rope_factors_short.weight"
                if "rope_factors_short.weight" in tensors
                else "rope_factors_long.weight",
            ),
        }
        if attn is not None:
            out["attention_factor"] = float(attn)
        if original is not None:
            cfg["original_max_position_embeddings"] = int(original)
        return out
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(field(reader, f"{arch}.rope.scaling.factor") or 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor}
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        for gguf_key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = field(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                out[name] = float(value)
        return out
    raise ValueError(f"{arch}.rope.scaling.type {kind!r} is not supported (linear, yarn)")


def _moe(reader: Any, arch: str, hf_arch: str, layers: int, tensors: dict[str, Any]) -> dict[str, Any]:
    def key(name: str) -> Any:
        return field(reader, f"{arch}.{name}")

    experts = int(key("expert_count") or 0)
    used = int(key("expert_used_count") or 0)
    norm = key("expert_weights_norm")
    if hf_arch == "MixtralForCausalLM":
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    out: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(key("expert_feed_forward_length") or 0),
        "norm_topk_prob": bool(norm) if norm is not None else hf_arch == "Qwen3MoeForCausalLM",
        "decoder_sparse_step": 1,
        # Layers the converter gave a dense feed-forward (no router).
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }
    if hf_arch == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length") or 0)
    return out


def _gemma(
    reader: Any, arch: str, layers: int, hidden: int, heads: int, head_dim: int, window: Any
) -> dict[str, Any]:
    def key(name: str) -> Any:
        return field(reader, f"{arch}.{name}")

    scale = hidden / heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    out: dict[str, Any] = {"query_pre_attn_scalar": scale, "hidden_activation": "gelu_pytorch_tanh"}
    # Absent soft-caps keep the architecture's defaults (Gemma 2: 50 and 30; Gemma 3: none).
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key(name) is not None:
            out[name] = float(key(name))
    if arch == "gemma2":
        out["sliding_window"] = int(window) if window else 4096  # llama.cpp's default for Gemma 2
        out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return out
    out["sliding_window"] = int(window) if window else None
    pattern = key("attention.sliding_window_pattern")
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern or 6)
        sliding = [i % n < n - 1 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    out["rope_local_base_freq"] = float(key("rope.freq_base_swa") or 10000.0)
    return out


def end_of_generation_ids(reader: Any) -> list[int]:
    """The file's EOS, EOT and EOM ids and the end-of-turn markers in its vocabulary, EOS first."""
    ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        value = field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    wanted = set(END_OF_TURN_TOKENS)
    for i, text in enumerate(field(reader, "tokenizer.ggml.tokens") or ()):
        if text in wanted and i not in ids:
            ids.append(i)
    return ids
