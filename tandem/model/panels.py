"""A bfloat16 weight in column panels: the layout `tandem.gemm_bf16_panels` reads (few-row products
on CPUs with AVX512-BF16 and no AMX; tandem/kernels/panel_ops.cpp says why this layout).

`pack_panels(w)` of w [N, K] is [ceil(N / 16), K / 2, 16, 2]: panel p holds output columns
16p .. 16p + 15 (zero rows past N), and for each pair of inputs j the 16 columns' weights
w[n, 2j], w[n, 2j + 1] side by side. The same bytes as the plain weight, plus the padding rows.
"""

from __future__ import annotations

import torch

# Output columns per panel: one float32 vector of sums in the kernel.
PANEL = 16


def can_pack(weight: torch.Tensor) -> bool:
    """The layout takes bfloat16 weights with an even number of inputs."""
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """w [N, K] bfloat16 (K even) -> [ceil(N / 16), K / 2, 16, 2]."""
    if not can_pack(weight):
        raise ValueError(
            f"pack_panels: needs a 2-D bfloat16 weight with an even number of columns, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = weight.detach()
    if panels * PANEL != n:
        w = torch.cat((w, w.new_zeros(panels * PANEL - n, k)))
    return w.reshape(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [n, K] back from its panels (a copy)."""
    p, half, _, _ = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(p * PANEL, half * 2)[:n].contiguous()
