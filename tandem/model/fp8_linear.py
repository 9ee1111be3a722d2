"""FP8 checkpoints' linear layers kept in float8_e4m3fn and run by `torch._scaled_mm`.

Where it runs (`fp8_weight_path`): on CUDA GPUs of compute capability 8.9 or more (Ada, Hopper),
which have fp8 tensor cores. Elsewhere an fp8 checkpoint's weights are widened to the model dtype
at load (tandem/model/quantized_weights.py), as before. `TANDEM_FP8_MATMUL=scaled_mm` forces the
fp8 path wherever torch's `_scaled_mm` runs (torch's CPU build has it: the tests use that), and
`widen` forces the old one.

The product is `_scaled_mm`'s row-wise recipe, the one both operands can share for every scale
layout an fp8 checkpoint has without block scales: the activation is quantized per token at run
time (scale = max|row| / 448, e4m3's largest finite value), the weight carries one scale per output
channel ([1, N]); a per-tensor scale becomes that scale on every row, which also lets a fused
q/k/v or gate/up layer hold shards that had a scale each. torch accepts row-wise scales only with
both operands row-wise, so a per-tensor activation scale would not combine with channel scales.

What `_scaled_mm` demands on CUDA, and how it is met: the first operand row-major (the quantized
activation is made contiguous), the second column-major (the weight is stored [N, K] row-major and
passed as its transpose, a view), K and N multiples of 16 (a layer that is not stays widened),
scales float32 [M, 1] and [1, N], the output in the model dtype: bfloat16 or float16, or float32
on compute capability 9.0 only (elsewhere a float32 model keeps the fp8 layers widened).

Not taken: block-wise scales (`weight_block_size`, DeepSeek-style 128x128), whose `_scaled_mm`
recipe needs cuBLAS 12.9 on sm90 and activation blocks of 1x128; those layers are widened, as are
fp8 experts of MoE models (stacked into one tensor per kind) and layers whose shapes miss the
multiples of 16.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.model.direct_call import DirectCall

FP8_MATMUL_ENV = "TANDEM_FP8_MATMUL"
FP8_MATMUL_CHOICES = ("scaled_mm", "widen")
# e4m3's largest finite value: a row's largest magnitude maps to it.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# A floor under per-token scales so an all-zero row (padding) divides by something.
_MIN_SCALE = 1e-12
# `_scaled_mm` on CUDA needs the inner and output dimensions in multiples of this.
DIM_MULTIPLE = 16

ScaledMM = Callable[..., torch.Tensor]


def fp8_weight_path(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[str, str]:
    """("scaled_mm" or "widen", why) for an fp8 checkpoint's linear layers on `device` in a model
    computing in `dtype`."""
    forced = os.environ.get(FP8_MATMUL_ENV, "").strip()
    if forced:
        if forced not in FP8_MATMUL_CHOICES:
            raise ValueError(f"{FP8_MATMUL_ENV} must be one of {FP8_MATMUL_CHOICES}, got {forced!r}")
        return forced, f"{FP8_MATMUL_ENV}={forced}"
    if device.type != "cuda":
        return "widen", f"no fp8 matrix units used on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return "widen", f"compute capability {major}.{minor} < 8.9 has no fp8 tensor cores"
    if dtype == torch.float32 and (major, minor) != (9, 0):
        # Row-wise scales with a float32 output go through cuBLAS, which takes them on sm90 only.
        return (
            "widen",
            f"float32 output of row-wise _scaled_mm needs compute capability 9.0, not {major}.{minor}",
        )
    return "scaled_mm", f"compute capability {major}.{minor}"


def row_scales(name: str, scale: torch.Tensor, out_features: int) -> torch.Tensor | None:
    """One float32 scale per output row [out] from a tensor or channel scale; None for a block
    scale (which stays widened)."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1).expand(out_features).contiguous()
    if s.dim() <= 2 and s.numel() == out_features and (s.dim() == 1 or s.shape[1] == 1):
        return s.reshape(out_features).contiguous()
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K] row-major, float32 scales [M, 1]) with x ~ q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).div_(FP8_MAX).clamp_(min=_MIN_SCALE)
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Linear(DirectCall, nn.Module):
    """y = x @ (q * scale).T + bias, with q float8_e4m3fn [out, in] and one scale per output row;
    x is quantized per token on each call. `matmul` is `torch._scaled_mm` (injected for tests)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        matmul: ScaledMM | None = None,
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.float8_e4m3fn or qweight.dim() != 2:
            raise ValueError(
                f"Fp8Linear takes a 2-D float8_e4m3fn weight, got {qweight.dtype} {tuple(qweight.shape)}"
            )
        self.out_features, self.in_features = qweight.shape
        if tuple(scale.shape) != (self.out_features,):
            raise ValueError(f"Fp8Linear scale must be [{self.out_features}], got {tuple(scale.shape)}")
        self.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        # [1, N]: the second operand's row-wise scale layout.
        self.scale = nn.Parameter(scale.float().reshape(1, -1).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._matmul: ScaledMM = torch._scaled_mm if matmul is None else matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self.forward(x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        q, sx = quantize_rows(x)
        # qweight.t() is the column-major [K, N] view _scaled_mm wants as its second operand.
        y = self._matmul(q, self.qweight.t(), scale_a=sx, scale_b=self.scale, out_dtype=x.dtype)
        return y if self.bias is None else y + self.bias


@dataclass
class Fp8Layers:
    """What `fp8_linears` found: model module name -> layer, and why each other fp8 layer was widened."""

    layers: dict[str, Fp8Linear] = field(default_factory=dict)
    widened: dict[str, str] = field(default_factory=dict)

    def summary(self, why: str) -> str:
        text = (
            f"{len(self.layers)} linear layers run torch._scaled_mm ({why}; weights float8_e4m3fn "
            "with a scale per output channel, activations quantized per token)"
        )
        if self.widened:
            reasons = sorted(set(self.widened.values()))
            text += f"; {len(self.widened)} widened to the model dtype ({', '.join(reasons)})"
        return text
