"""Build a model from a Hugging Face checkpoint folder: architecture registry and safetensors loading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tandem.config import ModelConfig
from tandem.model.attention import get_attention_backend
from tandem.model.kv_quant import KVCacheFormat
from tandem.model.layers import RotaryEmbedding
from tandem.model.linear import pack_linears
from tandem.model.llama import LlamaForCausalLM
from tandem.model.quant import quantize_model

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

# HF tensor name suffix -> (our parameter suffix, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 is the fast dtype on CPUs without native 16-bit matmul.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc!r}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint shard(s) listed in the index are missing: {', '.join(missing)}")
    return files


def _fused_slices(model: LlamaForCausalLM) -> dict[str, list[int]]:
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "self_attn.qkv_proj": [0, q, q + kv, q + 2 * kv],
        "mlp.gate_up_proj": [0, cfg.intermediate_size, 2 * cfg.intermediate_size],
    }


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    fused_done: dict[str, set[int]] = {}
    slices = _fused_slices(model)
    for file in checkpoint_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if "rotary_emb.inv_freq" in name:
                        continue
                    target, fused, shard = name.removeprefix("model."), None, 0
                    m = _LAYER_RE.match(name)
                    if m and m.group(2) in _FUSED:
                        fused, shard = _FUSED[m.group(2)]
                        target = f"layers.{m.group(1)}.{fused}.{m.group(3)}"
                    if target == "lm_head.weight" and model.lm_head is None:
                        continue  # tied embeddings: some checkpoints store the copy anyway
                    param = params.get(target)
                    if param is None:
                        raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                    tensor = f.get_tensor(name)
                    if fused is None:
                        dst = param.data
                    else:
                        bounds = slices[fused]
                        dst = param.data[bounds[shard] : bounds[shard + 1]]
                        fused_done.setdefault(target, set()).add(shard)
                    if tuple(tensor.shape) != tuple(dst.shape):
                        raise ValueError(
                            f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(dst.shape)}"
                        )
                    dst.copy_(tensor)
                    loaded.add(target)
        except SafetensorError as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc
    for target, shards in fused_done.items():
        if len(shards) != (3 if "qkv_proj" in target else 2):
            raise ValueError(f"checkpoint is missing part of the fused weight {target}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"checkpoint {folder} is missing tensors: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    max_positions: int,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> LlamaForCausalLM:
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"no model implementation for architecture {cfg.architecture!r}")
    backend = get_attention_backend(
        attention_backend,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.sliding_window,
        KVCacheFormat(kv_cache_dtype, dtype),
    )
    rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, device)
    with torch.device("meta"):
        model = cls(cfg, backend, rotary)
    # Materialise without random init; every parameter is then overwritten from the checkpoint.
    model = model.to_empty(device=device)
    load_weights(model, Path(cfg.path))
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    if quantization is not None:
        return quantize_model(model, quantization)
    return pack_linears(model)
