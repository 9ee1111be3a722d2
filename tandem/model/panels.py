"""A weight in column panels: the layout Tandem's few-row kernels read on CPUs with AVX-512 and no
AMX (`tandem.gemm_bf16_panels` for bfloat16, `tandem.gemm_w8a8_panels` for int8,
`tandem.gemm_int4_panels` for 4-bit; tandem/kernels/panel_ops.cpp says why this layout).

`pack_panels(w)` of w [N, K] is [ceil(N / 16), K / D, 16, D] with D inputs a 32-bit lane (2 for
bfloat16, 4 for int8): panel p holds output columns 16p .. 16p + 15 (zero rows past N), and for
each group j of D inputs the 16 columns' weights w[n, D j .. D j + D - 1] side by side. The same
bytes as the plain weight, plus the padding columns.
"""

from __future__ import annotations

import torch

# Output columns per panel: one vector of 32-bit sums in the kernels.
PANEL = 16
# Inputs per 32-bit lane, by weight dtype.
DEPTH = {torch.bfloat16: 2, torch.int8: 4}


def _pad_columns(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] with zero rows appended up to a whole number of panels."""
    n = t.shape[0]
    panels = -(-n // PANEL)
    return t if panels * PANEL == n else torch.cat((t, t.new_zeros(panels * PANEL - n, *t.shape[1:])))


def can_pack(weight: torch.Tensor) -> bool:
    """The layout takes bfloat16 weights with an even number of inputs, int8 with a multiple of 4."""
    depth = DEPTH.get(weight.dtype)
    return depth is not None and weight.dim() == 2 and weight.shape[1] % depth == 0


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """w [N, K] (bfloat16 or int8) -> [ceil(N / 16), K / D, 16, D]."""
    if not can_pack(weight):
        raise ValueError(
            "pack_panels: needs a 2-D bfloat16 weight with an even number of columns or an int8 one "
            f"with a multiple of 4, got {weight.dtype} {tuple(weight.shape)}"
        )
    k = weight.shape[1]
    depth = DEPTH[weight.dtype]
    w = _pad_columns(weight.detach())
    return w.reshape(-1, PANEL, k // depth, depth).permute(0, 2, 1, 3).contiguous()


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [n, K] back from its panels (a copy)."""
    p, lanes, _, depth = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(p * PANEL, lanes * depth)[:n].contiguous()


def pack_int4_panels(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] of 4-bit values 0..15 (K a multiple of 8) -> [ceil(N / 16), K / 8, 16, 4] uint8."""
    if q.dim() != 2 or q.shape[1] % 8:
        raise ValueError(f"pack_int4_panels: needs a 2-D [N, K] tensor with K a multiple of 8, got {tuple(q.shape)}")
    k = q.shape[1]
    lanes = _pad_columns(q.detach().to(torch.uint8)).reshape(-1, PANEL, k // 8, 2, 4)
    packed = lanes[:, :, :, 0] | (lanes[:, :, :, 1] << 4)
    return packed.permute(0, 2, 1, 3).contiguous()


def unpack_int4_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The 4-bit values [n, K] back from their panels."""
    p, lanes, _, _ = panels.shape
    b = panels.permute(0, 2, 1, 3).reshape(p * PANEL, lanes, 1, 4)[:n]
    return torch.cat((b & 0x0F, b >> 4), dim=2).reshape(n, lanes * 8).contiguous()


def pack_group_panels(values: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, G] (scales, zero terms) -> [ceil(N / 16), G, 16] float32."""
    g = values.shape[1]
    return _pad_columns(values.detach().float()).reshape(-1, PANEL, g).permute(0, 2, 1).contiguous()


def unpack_group_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """Per-group values [n, G] back from their panels, as float32."""
    p, g, _ = panels.shape
    return panels.permute(0, 2, 1).reshape(p * PANEL, g)[:n].float().contiguous()


def fits_half(values: torch.Tensor) -> bool:
    """Whether every value is exactly a float16 (finite, in range, no bits lost)."""
    return bool(torch.equal(values.half().float(), values.float()))
