"""int8 linear layers (`quantization="int8"`).

Weights: int8 with one symmetric scale per output channel (max |w| / 127), a quarter of float32's
bytes, which is what bounds small-batch decoding on a CPU. Activations: quantized to 8 bits at run
time with one scale per row (per token), accumulated in int32 and scaled back to float. On CPUs
with AMX, Tandem's tile kernel (`gemm_amx_w8a8`, the weight in its own tile layout) does every
product, quantizing inside the call: 1.5x oneDNN's int8 GEMM at 32 rows, 1.6x at 512 (prompt
chunks). On AVX512-VNNI CPUs without AMX, Tandem's kernel over the weight in column panels
(`gemm_w8a8_panels`, tandem/model/panels.py, which then stand in for the [out, in] weight) does
every product, quantizing inside the call: at memory speed for a few rows, 0.55-0.77x the time of
oneDNN's int8 GEMM from 1 to 512 rows (docs/benchmarks-kernels.md), and no library copy of the
weight. Where the panels are not built, `gemm_w8a8` over the rows takes up to eight rows; above
that the rows are quantized by Tandem (`quantize_rows_u8`) and multiplied by
oneDNN's int8 GEMM (`onednn::qlinear_pointwise`, VNNI, weight prepacked once), each result row
scaled by its own scale. One scale per row matters: PyTorch's `quantized::linear_dynamic` (kept where oneDNN's
operator is missing) takes one scale for the whole batch, so one large row (a first token's
activations often are) costs every other row its precision; on the default model that tripled the
logprob error of a prefill (tests/model/test_quant.py). All need a CPU with VNNI (AVX512-VNNI or
AVX-VNNI): without it, fbgemm's 8-bit products can overflow 16-bit sums, and its 7-bit fallback
costs too much accuracy (on the default model, greedy text parts from float's within a few tokens).
There (AVX2 alone) Tandem's kernel still takes up to 16 rows as W8A8, the same integer products
with `vpmaddubsw` (each activation's sign moved onto its weight, so no pair overflows 16 bits: the
results equal the VNNI kernel's); above that, and where PyTorch has no quantized engine, int8 runs
weight-only (float32 activations, as exact as the float reference): up to 64 rows through Tandem's
AVX2 kernel (`gemm_w8_f32`, the int8 weights widened in registers, so a decode step streams a
quarter of float32's bytes), above that widened to float per call and multiplied in plain torch
(slower than float32).
benchmarks/gemm_paths.py times the choices; docs/default_model.md reports the perplexity cost on
the default model.
"""

from __future__ import annotations

import logging
import warnings
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from tandem import kernels
from tandem.config import QUANTIZATION_METHODS
from tandem.cpu import cpu_flags
from tandem.model.direct_call import BoundTensors, DirectCall
from tandem.model.gate_up import (
    can_interleave,
    deinterleave,
    interleave_panels,
    interleave_tiles,
    interleaved_columns,
)
from tandem.model.linear import M, amx_tiles_available, replace_linears
from tandem.model.panels import can_pack, pack_panels, unpack_panels

logger = logging.getLogger("tandem.model")

# Rows up to which Tandem's int8 kernel (`gemm_w8a8`) runs (benchmarks/gemm_paths.py --few-rows): with
# VNNI, where it beats oneDNN's int8 GEMM; on AVX2 alone its whole 16, where it beats the
# weight-only kernel from one row (0.81x its time) and most from eight (0.63-0.69x).
_KERNEL_MAX_ROWS = 8
_AVX2_KERNEL_MAX_ROWS = 16
# Activation dtypes the few-row kernel reads directly.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Rows up to which the weight-only AVX2 kernel (no VNNI) runs, in calls of KERNEL_ROWS rows (each
# streams the weight once): widening the whole weight to float per call costs more up to here
# (benchmarks/gemm_paths.py: 16 rows 0.20 s against 1.28 s per pass over the 415M model's weights).
W8_KERNEL_MAX_ROWS = 64
_KERNEL_ROWS = 16
# Rows up to which SiLU-and-multiply runs in the int8 gate/up tile product's epilogue
# (tandem/model/gate_up.py; benchmarks/gate_up_silu.py, 415M shapes, three runs): 0.90-0.96x the
# time of the product then silu_mul at 8-64 rows; from 128 rows 1.04-1.22x (the product is bound
# by compute there and the epilogue's arithmetic adds to it).
_FUSED_SILU_MAX_ROWS = 64
# The column panels' form (CPUs with AVX512-VNNI and no AMX) takes every row count: unlike the
# tiles' epilogue, theirs is never slower than the two passes (docs/benchmarks-kernels.md).
PANEL_SILU_KERNEL = "gemm_w8a8_panels_silu_mul"


def dynamic_int8_available() -> bool:
    return "x86" in torch.backends.quantized.supported_engines or "fbgemm" in (
        torch.backends.quantized.supported_engines
    )


@cache
def onednn_int8_available() -> bool:
    """Can oneDNN's int8 linear (`onednn::qlinear_pointwise`, prepacked weight) run here?"""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return False
    try:
        w = torch.ops.onednn.qlinear_prepack(torch.ones(16, 16, dtype=torch.int8), None)
        x = torch.full((2, 16), 129, dtype=torch.uint8)
        zero, one = torch.zeros(16, dtype=torch.long), torch.ones(16)
        y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 128, w, one, zero, None, 1.0, 0, torch.float32, "none", [], "")
    except RuntimeError:
        return False
    return bool((y == 16).all())


def w8a8_kernel_max_rows() -> int:
    """Rows of an int8 product `gemm_w8a8` takes on this CPU (0 where it was not built)."""
    if not kernels.has("gemm_w8a8"):
        return 0
    return _KERNEL_MAX_ROWS if cpu_has_vnni() else _AVX2_KERNEL_MAX_ROWS


def cpu_has_vnni() -> bool:
    """True where int8 products quantize their activations too (AVX512-VNNI or AVX-VNNI)."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


class Int8Linear(BoundTensors, DirectCall, nn.Module):
    """y = x @ (q * scale)^T + b with q int8 [out, in], scale [out]; activations int8 on the fast path."""

    qweight: torch.Tensor | None  # buffers (register_buffer); None where `panels` hold the weight
    scale: torch.Tensor
    panels: torch.Tensor | None
    _bound = ("qweight", "scale", "bias", "panels")
    _tensors: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool | None = None
    ) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self._setup(q, scale, bias, use_kernel)

    @classmethod
    def from_int8(
        cls,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        use_kernel: bool | None = None,
    ) -> Int8Linear:
        """A layer over weights already quantized (int8 [out, in], float32 scales [out]): rows of
        another layer keep its exact values (the draft heads' read-out over a few LM-head rows)."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or tuple(scale.shape) != (qweight.shape[0],):
            raise ValueError(
                f"Int8Linear.from_int8 takes int8 [out, in] and scales [out], got {qweight.dtype} "
                f"{tuple(qweight.shape)} and {tuple(scale.shape)}"
            )
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(qweight.contiguous(), scale.detach().float().contiguous(), bias, use_kernel)
        return layer

    def _setup(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool | None
    ) -> None:
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        # use_kernel=False forces the float reference path (tests); None takes what the host has.
        self.use_kernel = use_kernel
        want = use_kernel is not False
        # AMX: the weight in tiles, for all rows (no library copy).
        self.tiles = torch.ops.tandem.amx_pack(q) if want and amx_tiles_available() else None
        # Tandem's VNNI and AMX kernels want each weight row's sum (they offset activations by 128;
        # the AVX2 form takes it and leaves it).
        int8_kernel = want and (self.tiles is not None or kernels.has("gemm_w8a8"))
        self.row_sum = q.sum(1, dtype=torch.int32) if int8_kernel else None
        # AVX512-VNNI without AMX: the weight in column panels (tandem/model/panels.py) for every
        # row count, which then replace the [out, in] weight (int8_weight() rebuilds it).
        panels = int8_kernel and self.tiles is None and kernels.has("gemm_w8a8_panels") and can_pack(q)
        self.register_buffer("panels", pack_panels(q) if panels else None, persistent=False)
        if panels:
            self.qweight = None
        # Otherwise, above the few-row kernel's rows: oneDNN's int8 GEMM (VNNI) on activations
        # quantized per row where it is there, else PyTorch's dynamic linear (one scale per tensor).
        self._qlinear = self._zero = self._packed = None
        if self.tiles is None and not panels and want and cpu_has_vnni():
            if onednn_int8_available() and kernels.has("quantize_rows_u8"):
                self._qlinear = torch.ops.onednn.qlinear_prepack(q, None)
                self._zero = torch.zeros(self.out_features, dtype=torch.long)
            elif dynamic_int8_available():
                self._packed = self._prepack()
        # Rows up to which the row kernel runs (0: none; the panels take every row count).
        self.kernel_max_rows = w8a8_kernel_max_rows() if int8_kernel and not panels else 0
        # Without VNNI: the weight-only kernel for few rows.
        self.weight_only_kernel = want and not cpu_has_vnni() and kernels.has("gemm_w8_f32")
        # Once fuse_silu laid the tiles or panels out for a gated MLP: the intermediate width, and the
        # per-column scale, sum and bias in their interleaved order.
        self.interleaved = 0
        self._tile_columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.bind_tensors()

    def fuse_silu(self, intermediate: int) -> bool:
        """As a gated MLP's gate/up layer, lay the tiles or the column panels out for `silu_mul`
        (tandem/model/gate_up.py); False where there are neither or the halves do not split into
        whole tiles."""
        if self.interleaved:
            return self.interleaved == intermediate
        if self.row_sum is None or not can_interleave(intermediate, self.out_features):
            return False
        _, scale, bias, panels = self._tensors
        order = interleaved_columns(intermediate)
        if self.tiles is not None:
            self.tiles = interleave_tiles(self.tiles, intermediate)
        elif panels is not None and kernels.has(PANEL_SILU_KERNEL):
            self.panels = interleave_panels(panels, intermediate)
            self.bind_tensors()
        else:
            return False
        self._tile_columns = (
            scale[order].contiguous(),
            self.row_sum[order].contiguous(),
            None if bias is None else bias[order].contiguous(),
        )
        self.interleaved = intermediate
        return True

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up layer's product of 2-D x (after `fuse_silu`): in the tile
        product's epilogue up to _FUSED_SILU_MAX_ROWS rows, else after the product."""
        tiles, columns, panels = self.tiles, self._tile_columns, self._tensors[3]
        if columns is None or x.dtype not in _KERNEL_DTYPES:
            return torch.ops.tandem.silu_mul(self.forward(x))
        scale, row_sum, bias = columns
        if panels is not None:  # every row count
            return torch.ops.tandem.gemm_w8a8_panels_silu_mul(x, panels, self.interleaved, scale, row_sum, bias)
        if tiles is None or x.shape[0] > _FUSED_SILU_MAX_ROWS:
            return torch.ops.tandem.silu_mul(self.forward(x))
        return torch.ops.tandem.gemm_amx_w8a8_silu_mul(x, tiles, self.interleaved, scale, row_sum, bias)

    def _prepack(self) -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized-tensor constructors warn of future removal
            qw = torch._make_per_channel_quantized_tensor(
                self.int8_weight(), self.scale.double(), torch.zeros(self.out_features, dtype=torch.long), 0
            )
            return torch.ops.quantized.linear_prepack(qw, self.bias)

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight [out, in]: the layer's own, or rebuilt from its panels (a copy)."""
        if self.qweight is not None:
            return self.qweight
        if self.panels is None:
            raise RuntimeError("Int8Linear holds neither its weight nor its panels")
        w = unpack_panels(self.panels, self.out_features)
        # Panels laid out for silu_mul hold the rows interleaved: gate then up again.
        return deinterleave(w.t(), self.interleaved).t().contiguous() if self.interleaved else w

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.int8_weight().to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self.forward(x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        qweight, scale, bias, panels = self._tensors
        if self.tiles is not None and x.dtype in _KERNEL_DTYPES:
            if self._tile_columns is not None:
                tile_scale, tile_sum, tile_bias = self._tile_columns
                y = torch.ops.tandem.gemm_amx_w8a8(x, self.tiles, self.out_features, tile_scale, tile_sum, tile_bias)
                return deinterleave(y, self.interleaved)
            return torch.ops.tandem.gemm_amx_w8a8(x, self.tiles, self.out_features, scale, self.row_sum, bias)
        if panels is not None:  # every row count; other activation dtypes through float32
            x2 = x if x.dtype in _KERNEL_DTYPES else x.float()
            if self._tile_columns is not None:  # laid out for silu_mul: interleaved columns
                panel_scale, panel_sum, panel_bias = self._tile_columns
                y = torch.ops.tandem.gemm_w8a8_panels(x2, panels, self.out_features, panel_scale, panel_sum, panel_bias)
                return deinterleave(y, self.interleaved).to(x.dtype)
            y = torch.ops.tandem.gemm_w8a8_panels(x2, panels, self.out_features, scale, self.row_sum, bias)
            return y.to(x.dtype)
        if self.row_sum is not None and 0 < x.shape[0] <= self.kernel_max_rows and x.dtype in _KERNEL_DTYPES:
            # A decode step's few rows: the kernel reads bfloat16 too and answers in x's dtype.
            return torch.ops.tandem.gemm_w8a8(x, qweight, scale, self.row_sum, bias)
        if x.dtype == torch.float32:
            return self._matmul(x)
        return self._matmul(x.float()).to(x.dtype)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """[rows, in] float32 -> [rows, out] float32, above the kernel's rows or without it."""
        if self._qlinear is not None and x2.shape[0] > 0:
            xq, x_scale = torch.ops.tandem.quantize_rows_u8(x2)
            y = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, self._qlinear, self.scale, self._zero, None, 1.0, 0, torch.float32, "none", [], ""
            )
            y.mul_(x_scale[:, None])  # the rows' scales: the GEMM took one scale (1) for all rows
            return y if self.bias is None else y.add_(self.bias)
        if self._packed is not None and x2.shape[0] > 0:
            return torch.ops.quantized.linear_dynamic(x2.contiguous(), self._packed, False)
        rows = x2.shape[0]
        if self.weight_only_kernel and 0 < rows <= W8_KERNEL_MAX_ROWS:
            if rows <= _KERNEL_ROWS:
                return torch.ops.tandem.gemm_w8_f32(x2, self.qweight, self.scale, self.bias)
            parts = [
                torch.ops.tandem.gemm_w8_f32(x2[i : i + _KERNEL_ROWS], self.qweight, self.scale, self.bias)
                for i in range(0, rows, _KERNEL_ROWS)
            ]
            return torch.cat(parts)
        # Per-channel scales commute with the matmul: scale the output columns instead.
        y = F.linear(x2, self.int8_weight().float()) * self.scale
        return y if self.bias is None else y + self.bias


def quantize_model(model: M, method: str | None, use_kernel: bool | None = None) -> M:
    """Swap every projection (attention, MLP, LM head) for its int8 form, in place.

    The token embedding stays in float: it is a lookup, not a matmul. A tied LM head gets its own
    quantized copy of the embedding matrix.
    """
    if method is None:
        return model
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {method!r}")
    if use_kernel is not False and not cpu_has_vnni():
        if kernels.has("gemm_w8_f32"):
            logger.warning(
                "this CPU has no VNNI: int8 runs weight-only (Tandem's AVX2 kernel up to %d rows, "
                "slower than float32 above)", W8_KERNEL_MAX_ROWS
            )
        else:
            logger.warning("this CPU has no VNNI: int8 runs weight-only, slower than float32")
    return replace_linears(model, lambda w, b: Int8Linear(w, b, use_kernel))


def quantize_selected(model: M, params: set[str], use_kernel: bool | None = None) -> list[str]:
    """Swap the linear layers whose weight is one of `params` (names in `model`, ".weight" ended)
    for their int8 form, in place; a tied LM head follows the embedding's name. Returns the
    layers swapped."""
    wanted = {p.removesuffix(".weight") for p in params}
    swapped = []
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear) and full in wanted:
                setattr(parent, name, Int8Linear(child.weight, child.bias, use_kernel))
                swapped.append(full)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None and "embed_tokens" in wanted:
        model.lm_head = Int8Linear(embed.weight, None, use_kernel)
        swapped.append("lm_head")
    return swapped
