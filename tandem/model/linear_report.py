"""The start-up report of a loaded model: which product each kind of linear layer runs, and the
bytes its weights take (logged by the loader, returned for tests and benchmarks)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tandem import kernels
from tandem.config import ModelConfig
from tandem.kernels.isa import kernel_instructions
from tandem.model.fp8_linear import Fp8Linear
from tandem.model.int4 import Int4Linear
from tandem.model.linear import FEW_ROW_KERNEL, PANEL_KERNEL, PackedLinear, mkl_max_rows
from tandem.model.quant import W8_KERNEL_MAX_ROWS, Int8Linear

logger = logging.getLogger("tandem.model")


@dataclass
class LayerKind:
    path: str
    count: int = 0
    bytes: int = 0


def _tensor_bytes(*tensors: torch.Tensor | None) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        # oneDNN's reordered weights have no plain storage (and may pad a little: counted as dense).
        key = id(t) if t.is_mkldnn else t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def linear_path(m: nn.Module) -> tuple[str, int]:
    """(what the layer runs, its weight bytes) for one linear layer."""
    if isinstance(m, Fp8Linear):
        return "torch._scaled_mm fp8, rows quantized one by one", _tensor_bytes(m.qweight, m.scale, m.bias)
    if isinstance(m, Int4Linear):
        held = (m.qweight, m.scales, m.zs, m.panels, m.panel_scales, m.panel_zs, m.bias)
        return f"{m.path()}, groups of {m.group_size}", _tensor_bytes(*held)
    if isinstance(m, Int8Linear):
        if m.tiles is not None:
            return "int8 AMX tile kernel, rows quantized one by one", _tensor_bytes(
                m.qweight, m.tiles, m.scale, m.row_sum, m.bias
            )
        if m.panels is not None:
            name = "gemm_w8a8_panels"
            path = f"int8 kernel {name} ({kernel_instructions(name)}, weight in column panels, every row count)"
            return path, _tensor_bytes(m.panels, m.scale, m.row_sum, m.bias)
        library = None
        if m._qlinear is not None:
            library = "oneDNN int8, rows quantized one by one"
        elif m._packed is not None:
            library = "PyTorch dynamic int8"
        weight_only = f"int8 weight-only kernel gemm_w8_f32 ({kernel_instructions('gemm_w8_f32')}, <= {W8_KERNEL_MAX_ROWS} rows)"
        if m.row_sum is not None:
            name = "gemm_w8a8"
            kernel = f"int8 kernel {name} ({kernel_instructions(name)}, <= {m.kernel_max_rows} rows)"
            rest = library or (f"{weight_only} + widened to float above" if m.weight_only_kernel else None)
            path = f"{kernel} + {rest or 'int8 weights widened to float'}"
        elif library is not None:
            path = library
        elif m.weight_only_kernel:
            path = f"{weight_only} + widened to float above"
        else:
            path = "int8 weights widened to float (no VNNI)"
        # The prepacked copy the library keeps for its int8 GEMM is about as large as qweight.
        extra = m.in_features * m.out_features if library is not None else 0
        return path, _tensor_bytes(m.qweight, m.scale, m.row_sum, m.bias) + extra
    if isinstance(m, PackedLinear):
        dtype = str(m.dtype).removeprefix("torch.")
        if m.packed is None and m.panels is not None:
            name = f"{PANEL_KERNEL} ({kernel_instructions(PANEL_KERNEL)})"
            return f"{name} {dtype}, every row count (one copy)", _tensor_bytes(m.panels, m.bias)
        if m.packed is None:
            return f"AMX tiles {dtype}, every row count (one copy)", _tensor_bytes(m.tiles, m.bias)
        has_few = m.plain is not None or m.panels is not None
        few = f" + {few_row_paths(m.dtype, m.plain_max_rows, m.panels is not None)}" if has_few else ""
        if m.tiles is not None:
            few = f" + AMX tiles for <= {m.tiles_max_rows} rows"
        return f"packed oneDNN {dtype}{few}", _tensor_bytes(m.packed, m.plain, m.panels, m.tiles, m.bias)
    if isinstance(m, nn.Linear):
        return f"F.linear {str(m.weight.dtype).removeprefix('torch.')}", _tensor_bytes(m.weight, m.bias)
    raise TypeError(f"not a linear layer: {type(m).__name__}")


def few_row_paths(dtype: torch.dtype, max_rows: int, panels: bool = False) -> str:
    """What a PackedLinear's plain weight (or its `panels`) serves, up to `max_rows` rows: MKL's
    sgemv (float32, one or two rows on AVX-512), then Tandem's kernel, named with its instructions."""
    low = mkl_max_rows(dtype)
    name = PANEL_KERNEL if panels else FEW_ROW_KERNEL[dtype]
    parts = [f"MKL sgemv for <= {min(low, max_rows)} rows"] if low else []
    if max_rows > low and kernels.has(name):
        parts.append(f"{name} ({kernel_instructions(name)}) for <= {max_rows} rows")
    return ", ".join(parts)


LINEAR_TYPES = (Fp8Linear, Int4Linear, Int8Linear, PackedLinear, nn.Linear)


def linear_report(model: nn.Module) -> tuple[dict[str, LayerKind], int]:
    """Linear layers by name (q/k/v, o, gate/up, down, LM head) and the model's total weight bytes."""
    kinds: dict[str, LayerKind] = {}
    linear_bytes = 0
    linear_ids: set[int] = set()
    for name, m in model.named_modules():
        if isinstance(m, LINEAR_TYPES):
            path, nbytes = linear_path(m)
            kind = kinds.setdefault(name.rpartition(".")[2], LayerKind(path))
            if kind.path != path:
                kind.path = "mixed"
            kind.count += 1
            kind.bytes += nbytes
            linear_bytes += nbytes
            linear_ids.update(id(t) for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    rest = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in linear_ids]
    if getattr(model, "lm_head", "absent") is None:  # tied: the head multiplies the embedding
        kinds["lm_head"] = LayerKind("F.linear with the tied embedding", 1, 0)
    return kinds, linear_bytes + _tensor_bytes(*rest)


def log_linear_paths(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> None:
    kinds, total = linear_report(model)
    source = "float" if cfg.quantization is None else f"{cfg.quantization.method} {cfg.quantization.weights}"
    if cfg.gguf_file is not None:
        source = "GGUF"
    parts = [f"{name} x{k.count}: {k.path} ({k.bytes / 2**20:.1f} MiB)" for name, k in kinds.items()]
    logger.info(
        "weights: %.1f MiB (%s checkpoint, %s); linear layers: %s",
        total / 2**20,
        source,
        str(dtype).removeprefix("torch."),
        "; ".join(parts),
    )
