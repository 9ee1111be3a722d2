"""Which GEMM a linear layer runs, by dtype and number of rows (CPU).

`F.linear` goes to MKL's sgemm with the weight as stored. For the 3-64-row products of batched
decoding and speculative verification that path is slow: oneDNN with the weight reordered once
into its blocked layout (`mkldnn._linear_pointwise`) is up to 1.9x faster in float32 and faster in
bfloat16 from 8 rows on (benchmarks/gemm_paths.py, results in docs/benchmarks-kernels.md). A
product of a few rows is bound by reading the weight from memory, and there a kernel that streams
the weight once, in the order it is stored, is best: on CPUs with AMX, Tandem's tile kernel
(`gemm_amx_bf16`, its own weight layout) for 1-64 bfloat16 rows, 1.2-1.3x oneDNN from 8 rows on
(every row count for layers no wider out than in, where oneDNN is slow at prompt sizes too);
on AVX-512 CPUs MKL's sgemv for one or two float32 rows (the same call transformers makes, so a
single stream's logits stay bit-identical to it), Tandem's own kernels (tandem/kernels) for 3-16
float32 rows and, with AVX512-BF16 and no AMX, bfloat16 products of every row count (over the
weight in column panels, tandem/model/panels.py, its only copy there); on AVX2-only CPUs (AMD Zen
2/3) MKL's sgemv streams at half the memory bandwidth, so Tandem's AVX2 kernel takes 1-8 float32
rows. So layers keep two forms of the weight where a few-row path exists: oneDNN's and the plain,
panel or tiled one, as long as two copies fit (`SECOND_COPY_MAX_MEMORY_FRACTION`); else one (the
tiles on AMX).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Set
from functools import cache
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from tandem import kernels
from tandem.config import SECOND_COPY_MAX_MEMORY_FRACTION
from tandem.cpu import cpu_flags
from tandem.model.direct_call import DirectCall
from tandem.model.gate_up import can_interleave, deinterleave, interleave_panels, interleave_tiles
from tandem.model.panels import can_pack, pack_panels

M = TypeVar("M", bound=nn.Module)
logger = logging.getLogger(__name__)

# float32 rows that MKL's sgemv takes on AVX-512 CPUs (bit-identical to transformers' own F.linear);
# on AVX2-only CPUs it runs at half the memory bandwidth there and Tandem's kernel takes them.
MKL_MAX_ROWS = 2 if "avx512f" in cpu_flags() else 0
FEW_ROW_KERNEL = {torch.float32: "gemv_f32", torch.bfloat16: "gemv_bf16"}
# The bfloat16 few-row kernel over a PackedLinear's weight in column panels (plain_product's
# stacked experts, held as stored, keep gemv_bf16).
PANEL_KERNEL = "gemm_bf16_panels"
# Its form for a gated MLP's gate/up layer, ending in SiLU-and-multiply (tandem/model/gate_up.py).
PANEL_SILU_KERNEL = "gemm_bf16_panels_silu_mul"


def kernel_max_rows(dtype: torch.dtype, flags: Set[str] | None = None) -> int:
    """Rows up to which Tandem's few-row kernel beats oneDNN for `dtype` on a CPU with `flags` (this
    one's when None; benchmarks/gemm_paths.py --few-rows). With AVX-512 the kernels stream the weight
    once per six activation rows, with AVX2 once per two (oneDNN wins from about twelve float32
    rows there). In bfloat16, oneDNN on AMX wins from about five rows; without AMX, oneDNN's
    AVX512-BF16 product is slower than the kernel at every row count up to the kernel's 16."""
    f = cpu_flags() if flags is None else flags
    if dtype == torch.float32:
        return 16 if "avx512f" in f else 8
    return 4 if "amx_bf16" in f else 16


# bfloat16 rows up to which the AMX tile kernel runs: above, a product is bound by compute and
# oneDNN's blocking ties or wins (benchmarks/gemm_paths.py: even at 64-128 and 512 rows, 0.88x at 256).
_AMX_MAX_ROWS = 64
# ... except for layers whose output is no wider than their input (o_proj, down_proj): there
# oneDNN's blocking is slow at prompt sizes and the tile kernel runs every row count, so those
# layers need no oneDNN copy (benchmarks/gemm_paths.py --per-shape, 415M shapes: at 512 rows the
# tiles take 0.60x oneDNN's time on o_proj and 0.95x on down_proj, at 1024 rows 0.55-0.66x; on the
# wider qkv and gate_up 1.08-1.09x at 512).
# Row limit of a path that takes every row count.
_ANY_ROWS = 1 << 62
# Batch-size hint oneDNN tunes the reordered layout for: mid-size decode batches.
_PACK_HINT_ROWS = 8


def mkl_max_rows(dtype: torch.dtype) -> int:
    """Rows of a product in `dtype` that go to MKL's sgemv on this CPU (float32 only)."""
    return MKL_MAX_ROWS if dtype == torch.float32 else 0


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Can oneDNN pack and run linear weights of `dtype` on this CPU? (bfloat16 needs AVX-512 or
    AVX-NE-CONVERT; on an AVX2-only CPU its reorder raises, so those layers stay on `F.linear`.)"""
    return _onednn_packs(dtype)


@cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16, dtype=dtype), _PACK_HINT_ROWS)
    except RuntimeError:
        return False
    return True


def bf16_panels_every_row_count(flags: Set[str] | None = None) -> bool:
    """Whether a bfloat16 layer runs its column panels (`gemm_bf16_panels`) at every row count and
    holds no oneDNN copy, on a CPU with `flags` (this one's when None): with AVX512-BF16 and no AMX,
    where both run on the same `vdpbf16ps` and the panels tie or win at every row count (AMD EPYC
    kind, benchmarks/gemm_paths.py --few-rows 16,32,64,128,512 --only bfloat16: 0.87-0.99x oneDNN's
    time, 0.42 TFLOP/s at 512 rows, 90% of the instruction's peak there)."""
    f = cpu_flags() if flags is None else flags
    return "avx512_bf16" in f and "amx_bf16" not in f


def amx_tiles_available() -> bool:
    """Tandem's AMX tile kernels built on this CPU and the OS lets this process use the tiles."""
    return kernels.has("gemm_amx_bf16") and bool(torch.ops.tandem.amx_ready())


class PackedLinear(DirectCall, nn.Module):
    """A linear layer whose weight is held in oneDNN's reordered layout (CPU only), and, with
    `second_copy`, also in the form a few-row path reads: AMX tiles for bfloat16, else column panels
    for bfloat16 (tandem/model/panels.py) and the plain weight for float32. Without it the layer
    holds one copy: the tiles alone on AMX (every row count runs on them), oneDNN's layout alone
    elsewhere. A bfloat16 layer on a CPU with AVX512-BF16 and no AMX holds its panels alone and runs
    every row count on them (`bf16_panels_every_row_count`), whatever `second_copy` says."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, second_copy: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        self.second_copy = second_copy  # a layer over some of these rows is built the same way
        w = weight.detach().contiguous()
        # bfloat16 on AMX: the weight in tiles, for decode-sized batches; for every row count where
        # the layer holds one copy or its output is no wider than its input (see _AMX_MAX_ROWS).
        self.tiles = torch.ops.tandem.amx_pack(w) if w.dtype == torch.bfloat16 and amx_tiles_available() else None
        tiles_only = self.tiles is not None and (not second_copy or self.out_features <= self.in_features)
        self.tiles_max_rows = 0 if self.tiles is None else _ANY_ROWS if tiles_only else _AMX_MAX_ROWS
        # Else the plain weight or its panels, where a few-row path exists for this dtype.
        panels = w.dtype == torch.bfloat16 and kernels.has(PANEL_KERNEL) and can_pack(w)
        panels_only = panels and self.tiles is None and bf16_panels_every_row_count()
        one_copy = tiles_only or panels_only
        self.packed = None if one_copy else torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)
        if panels_only:
            few = _ANY_ROWS
        elif self.tiles is not None or not second_copy:
            few = 0
        elif panels or kernels.has(FEW_ROW_KERNEL[w.dtype]):
            few = kernel_max_rows(w.dtype)
        else:
            few = mkl_max_rows(w.dtype)
        self.panels = pack_panels(w) if few and panels else None
        self.plain = w if few and self.panels is None else None
        self.plain_max_rows = few  # rows the plain weight or the panels take
        self.bias = None if bias is None else bias.detach().contiguous()
        self.interleaved = 0  # the intermediate width once fuse_silu laid the tiles or panels out for it

    def fuse_silu(self, intermediate: int) -> bool:
        """As a gated MLP's gate/up layer, lay the tiles, or the panels where they take every row
        count, out for `silu_mul` (tandem/model/gate_up.py); False where there are neither, a bias,
        or halves that do not split into whole tiles."""
        if self.interleaved:
            return self.interleaved == intermediate
        if self.bias is not None or not can_interleave(intermediate, self.out_features):
            return False
        if self.tiles is not None:
            self.tiles = interleave_tiles(self.tiles, intermediate)
        elif self.panels is not None and self.packed is None and kernels.has(PANEL_SILU_KERNEL):
            self.panels = interleave_panels(self.panels, intermediate)
        else:
            return False
        self.interleaved = intermediate
        return True

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up layer's product of 2-D x (after `fuse_silu`): in the tile
        or panel product's epilogue on its rows, else after the product."""
        tiles = self.tiles
        if tiles is not None and x.shape[0] <= self.tiles_max_rows and x.dtype == torch.bfloat16:
            return torch.ops.tandem.gemm_amx_bf16_silu_mul(x, tiles, self.interleaved)
        if self.panels is not None and self.packed is None:  # the panels take every row count
            return torch.ops.tandem.gemm_bf16_panels_silu_mul(x, self.panels, self.interleaved)
        return torch.ops.tandem.silu_mul(self.forward(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the decoder passes 2-D input: no reshapes on its path
            y = self.forward(x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        tiles = self.tiles
        if tiles is not None and rows <= self.tiles_max_rows and x.dtype == torch.bfloat16:
            y = torch.ops.tandem.gemm_amx_bf16(x, tiles, self.out_features, self.bias)
            return deinterleave(y, self.interleaved) if self.interleaved else y
        if rows <= self.plain_max_rows and self.panels is not None:
            y = torch.ops.tandem.gemm_bf16_panels(x, self.panels, self.out_features, self.bias)
            return deinterleave(y, self.interleaved) if self.interleaved else y
        plain = self.plain  # None when plain_max_rows is 0
        if plain is not None and rows <= self.plain_max_rows:
            if plain.dtype == torch.float32:
                if rows <= MKL_MAX_ROWS:  # never on AVX2-only CPUs (0)
                    return F.linear(x, plain, self.bias)
                return torch.ops.tandem.gemv_f32(x, plain, self.bias)
            return torch.ops.tandem.gemv_bf16(x, plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def plain_product(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`x @ w.T` for weights of `dtype` kept only as stored (no oneDNN copy: stacked MoE experts):
    Tandem's few-row kernel for the rows PackedLinear gives it where it built, `F.linear` otherwise."""
    name = FEW_ROW_KERNEL.get(dtype)
    if name is None or not kernels.has(name):
        return F.linear
    kernel = getattr(torch.ops.tandem, name)
    low = mkl_max_rows(dtype)
    high = kernel_max_rows(dtype)

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernel(x, w, None) if low < x.shape[0] <= high else F.linear(x, w)

    return product


@torch.inference_mode()
def warm_row_counts(model: nn.Module, rows: range) -> None:
    """Run each distinct packed-layer shape once at each of `rows` rows.

    oneDNN builds a primitive the first time it sees a row count, about 0.6 ms per layer shape here;
    done in a live step, that landed in the first verification step of each new batch size (a 20-row
    step of the default model took 15 ms instead of 6), which the speculation gate then measured."""
    seen = set()
    for m in model.modules():
        if isinstance(m, PackedLinear) and m.packed is not None and (m.in_features, m.out_features, m.dtype) not in seen:
            seen.add((m.in_features, m.out_features, m.dtype))
            for r in rows:
                if r > max(m.plain_max_rows, m.tiles_max_rows):
                    m(torch.zeros(r, m.in_features, dtype=m.dtype))


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and onednn_available(weight.dtype)
    )


LinearFactory = Callable[[torch.Tensor, torch.Tensor | None], nn.Module | None]


def replace_linears(model: M, make: LinearFactory) -> M:
    """Swap each `nn.Linear` for `make(weight, bias)` (kept where that returns None), in place.

    A tied LM head (`lm_head is None`) becomes `make(embedding matrix, None)`: the embedding stays a
    float lookup, the head gets its own form of the same matrix.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                new = make(child.weight, child.bias)
                if new is not None:
                    setattr(parent, name, new)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None:
        head = make(embed.weight, None)
        if head is not None:
            model.lm_head = head
    return model


def pack_linears(model: M, second_copy: bool | None = None) -> M:
    """Swap float32/bfloat16 linear layers (tied LM head included) of a CPU model for `PackedLinear`.

    `second_copy` (None: decided by `keeps_second_copy` from the weights' size and the memory
    available now) lets each layer hold a second form of its weight for the few-row path."""
    if not onednn_available():
        return model
    if second_copy is None:
        weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and _packable(m.weight)]
        second_copy = keeps_second_copy(sum(w.numel() * w.element_size() for w in weights), available_memory())
        if not second_copy:
            logger.info("linear weights held once (no second form for the few-row path): memory is short")
    two = second_copy
    return replace_linears(model, lambda w, b: PackedLinear(w, b, two) if _packable(w) else None)


def keeps_second_copy(weight_bytes: int, available_bytes: int | None) -> bool:
    """Whether the linear layers' second copy (SECOND_COPY_MAX_MEMORY_FRACTION) fits: always where
    the available memory is unknown."""
    if available_bytes is None:
        return True
    return weight_bytes <= SECOND_COPY_MAX_MEMORY_FRACTION * available_bytes


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (Linux /proc/meminfo), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
