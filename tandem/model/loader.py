"""Build a model from a Hugging Face checkpoint folder: architecture registry and safetensors loading."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.model.attention import get_attention_backend
from tandem.model.gemma import GemmaForCausalLM
from tandem.model.interface import CausalLM, CausalLMClass
from tandem.model.layers import RotaryEmbedding
from tandem.model.linear import pack_linears
from tandem.model.llama import LlamaForCausalLM
from tandem.model.phi3 import Phi3ForCausalLM
from tandem.model.quant import quantize_model
from tandem.model.weights import load_weights

# Architecture name in config.json -> the class that implements it.
MODEL_REGISTRY: dict[str, CausalLMClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 is the fast dtype on CPUs without native 16-bit matmul.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    max_positions: int,
    quantization: str | None = None,
) -> CausalLM:
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"no model implementation for architecture {cfg.architecture!r}")
    backend = get_attention_backend(
        attention_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window
    )
    rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, device)
    with torch.device("meta"):
        model = cls(cfg, backend, rotary)
    # Materialise without random init; every parameter is then overwritten from the checkpoint.
    module = model_module(model).to_empty(device=device)
    load_weights(module, model, Path(cfg.path))
    module = module.to(dtype=dtype).eval().requires_grad_(False)
    if quantization is not None:
        quantize_model(module, quantization)
    else:
        pack_linears(module)
    return model


def model_module(model: CausalLM) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{type(model).__name__} is not a torch module")
    return model
