"""Build a model from a Hugging Face checkpoint folder (or one prepared from a GGUF file, whose weights
the GGUF reader supplies): architecture registry and weight loading."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from tandem.config import GGUF_QUANTIZATION, QUANTIZATION_METHODS, ModelConfig
from tandem.cpu import cpu_flags
from tandem.model.attention import get_attention_backend
from tandem.model.direct_call import bind_submodules
from tandem.model.dummy_weights import fill_dummy_weights
from tandem.model.experts import Experts, prepare_experts
from tandem.model.fp8_linear import fp8_weight_path
from tandem.model.fused_ops import use_fused_ops, wants_fused_ops
from tandem.model.gemma import GemmaForCausalLM
from tandem.model.gguf_weights import GGUFCheckpoint, gguf_mode
from tandem.model.huge_pages import huge_pages_available, move_weights_to_huge_pages
from tandem.model.int4 import Int4Linear
from tandem.model.interface import CausalLM, CausalLMClass
from tandem.model.kv_quant import KVCacheFormat
from tandem.model.layers import RotaryEmbedding
from tandem.model.linear import onednn_available, pack_linears
from tandem.model.linear_report import log_linear_paths
from tandem.model.llama import LlamaForCausalLM
from tandem.model.moe import MoEForCausalLM
from tandem.model.phi3 import Phi3ForCausalLM
from tandem.model.quant import cpu_has_vnni, quantize_model, quantize_selected
from tandem.model.quantized_weights import BiasOnly, QuantizedCheckpoint, swap_module
from tandem.model.weights import load_weights
from tandem.quantization_config import resolve_method

logger = logging.getLogger(__name__)

# Architecture name in config.json -> the class that implements it.
MODEL_REGISTRY: dict[str, CausalLMClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


# Overrides what dtype="auto" means on a CPU ("float32" or "bfloat16"); the test suite sets float32
# so that its exactness checks against transformers hold on every machine.
AUTO_DTYPE_ENV = "TANDEM_AUTO_DTYPE"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return _DTYPES[auto_dtype(device)[0]]
    return _DTYPES[name]


def auto_dtype(device: torch.device) -> tuple[str, str]:
    """What dtype="auto" picks on `device`, and why (said at start-up)."""
    if device.type != "cpu":
        return "bfloat16", f"{device.type} device"
    forced = os.environ.get(AUTO_DTYPE_ENV, "").strip()
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{AUTO_DTYPE_ENV} must be float32 or bfloat16, got {forced!r}")
        return forced, f"{AUTO_DTYPE_ENV}={forced}"
    # bfloat16 matmuls run natively (AMX tiles or AVX512-BF16 dot products) and read half float32's
    # bytes; without those instructions they are emulated and slower than float32.
    native = sorted({"amx_bf16", "avx512_bf16"} & cpu_flags())
    if native and onednn_available(torch.bfloat16):
        return "bfloat16", f"the CPU has {' and '.join(native)}"
    return "float32", "the CPU has no AMX-BF16 or AVX512-BF16"


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    max_positions: int,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    cpu_kernels: bool = True,
    load_format: str = "auto",
    seed: int = 0,
) -> CausalLM:
    """`cpu_kernels`: Tandem's CPU paths (oneDNN-packed linears, the C++ kernels, huge pages);
    False (the GPU path, tandem/worker/device.py): plain torch layers, nothing built or packed.
    `load_format` "dummy": random weights of the config's shape, seeded by `seed`, made on `device`
    (tandem/model/dummy_weights.py); no weight file is read."""
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"no model implementation for architecture {cfg.architecture!r}")
    if load_format == "dummy":
        args = (attention_backend, max_positions, quantization, kv_cache_dtype, cpu_kernels, seed)
        return _load_dummy(cls, cfg, dtype, device, *args)
    int4_checkpoint = cfg.quantization is not None and cfg.quantization.weights == "int4"
    if device.type != "cpu" and (cfg.gguf_file is not None or int4_checkpoint):
        what = "a GGUF file" if cfg.gguf_file is not None else "a 4-bit checkpoint"
        raise ValueError(
            f"{cfg.path}: {what} runs on Tandem's CPU kernels only; on {device.type}, load a float or fp8 one"
        )
    gguf: GGUFCheckpoint | None = None
    if cfg.gguf_file is not None:
        packed, at_load = gguf_mode(quantization)
        gguf = GGUFCheckpoint(cfg, packed, dtype)
    elif quantization == GGUF_QUANTIZATION:
        raise ValueError(
            f"quantization={quantization!r} needs a GGUF file (model=PATH.gguf); {cfg.path} is not one"
        )
    else:
        # "int8" for a float checkpoint, None otherwise; a disagreement with the checkpoint raises.
        at_load = resolve_method(quantization, cfg.quantization)
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
    module = model_module(model).to_empty(device=device)
    folder = Path(cfg.path)
    int4: dict[str, Int4Linear] = {}
    ckpt: GGUFCheckpoint | QuantizedCheckpoint | None = gguf
    if ckpt is None and cfg.quantization is not None:
        ckpt = QuantizedCheckpoint(cfg.quantization, folder)
    if ckpt is None:
        load_weights(module, model, folder)
    else:
        int4 = ckpt.int4_layers(module, model)
        # The float loader then sees only their biases; the 4-bit layers go in after the cast to
        # `dtype`, which must not touch their float32 scales.
        for name in int4:
            swap_module(module, name, BiasOnly(module.get_submodule(name)))
        params = {n for n, _ in module.named_parameters()}
        load_weights(module, model, folder, ckpt.tensors(params, model))
    if gguf is not None:
        why = "" if gguf.packed else " (a dtype given, no quantization: 'gguf' keeps 4-bit blocks packed)"
        logger.info("GGUF %s: %s%s", Path(gguf.file).name, gguf.report.summary(), why)
    module = module.to(dtype=dtype).eval().requires_grad_(False)
    if isinstance(ckpt, QuantizedCheckpoint) and ckpt.qcfg.weights == "fp8":
        _keep_fp8(module, model, ckpt, device, dtype)
    for name, lin in int4.items():
        bias = swap_module(module, name, lin).bias
        if isinstance(bias, torch.Tensor):
            lin.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    if at_load is not None:
        quantize_model(module, at_load, use_kernel=None if cpu_kernels else False)
    elif cpu_kernels:
        if gguf is not None and cpu_has_vnni():
            swapped = quantize_selected(module, gguf.eight_bit_params())
            if swapped:
                more = f" and {len(swapped) - 3} more" if len(swapped) > 3 else ""
                logger.info("GGUF: layers stored in 8-bit blocks run as int8: %s%s", ", ".join(swapped[:3]), more)
        pack_linears(module)
    quantized = at_load is not None or cfg.quantization is not None or bool(int4)
    _finish(module, model, cfg, dtype, device, at_load, quantized, cpu_kernels)
    return model


def _keep_fp8(
    module: nn.Module, mapping: CausalLM, ckpt: QuantizedCheckpoint, device: torch.device, dtype: torch.dtype
) -> None:
    """Where `fp8_weight_path` says so, swap the widened fp8 layers for `Fp8Linear`s."""
    path, why = fp8_weight_path(device, dtype)
    if path != "scaled_mm":
        logger.info("fp8 checkpoint: weights widened to the model dtype at load (%s)", why)
        return
    found = ckpt.fp8_linears(module, mapping)
    for name, lin in found.layers.items():
        swap_module(module, name, lin)
    logger.info("fp8 checkpoint: %s", found.summary(why))


def _finish(
    module: nn.Module,
    model: CausalLM,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    at_load: str | None,
    quantized: bool,
    cpu_kernels: bool,
) -> None:
    """What every loaded model gets after its weights: the experts' path, the per-token ops, huge
    pages (CPU paths only), the start-up report, direct calls."""
    prepare_experts(module, at_load, use_kernel=None if cpu_kernels else False)
    if not cpu_kernels:
        for m in module.modules():
            if isinstance(m, Experts):
                m.cpu_kernels = False
    # Before the move to huge pages: fusing SiLU into the gate/up product re-lays those weights out.
    fused = use_fused_ops(module) if cpu_kernels and wants_fused_ops(dtype, quantized) else []
    if cpu_kernels and device.type == "cpu" and huge_pages_available():
        moved = move_weights_to_huge_pages(module)
        logger.info("weights on transparent huge pages: %.0f MB", moved / 2**20)
    log_linear_paths(module, cfg, dtype)
    logger.info(
        "per-token ops (norms, activation, rotary): %s",
        f"compiled kernels ({', '.join(fused)})" if fused else "PyTorch operators",
    )
    describe = getattr(getattr(module, "backend", None), "describe", None)
    if describe is not None:
        logger.info("attention: %s", describe())
    bind_submodules(module)


def _load_dummy(
    cls: CausalLMClass,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    max_positions: int,
    quantization: str | None,
    kv_cache_dtype: str,
    cpu_kernels: bool,
    seed: int,
) -> CausalLM:
    """load_format="dummy": the model built in `dtype` straight on `device` (no float32 copy, no
    file), its weights drawn by `fill_dummy_weights`; then the same preparation as a checkpoint."""
    if cfg.gguf_file is not None or cfg.quantization is not None:
        what = "a GGUF file" if cfg.gguf_file is not None else "a quantization_config"
        raise ValueError(f"load_format='dummy' makes float weights; {cfg.path} names {what}: remove it")
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"load_format='dummy' makes float weights: quantization={quantization!r} names no file")
    kv_format = KVCacheFormat(kv_cache_dtype, dtype)
    backend = get_attention_backend(
        attention_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window, kv_format
    )
    rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, device)
    with torch.device("meta"):
        model = cls(cfg, backend, rotary)
    module = model_module(model).to(dtype=dtype).to_empty(device=device)
    fill_dummy_weights(module, seed, norm_offset=cfg.gemma is not None)
    module = module.eval().requires_grad_(False)
    at_load = quantization
    if at_load is not None:
        quantize_model(module, at_load, use_kernel=None if cpu_kernels else False)
    elif cpu_kernels:
        pack_linears(module)
    logger.info("load_format dummy: random weights (seed %d), %s on %s", seed, dtype, device)
    _finish(module, model, cfg, dtype, device, at_load, at_load is not None, cpu_kernels)
    return model


def model_module(model: CausalLM) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{type(model).__name__} is not a torch module")
    return model
