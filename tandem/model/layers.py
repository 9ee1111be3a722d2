"""Building blocks of the decoder: RMSNorm, rotary embeddings, gated MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 whatever the weight dtype, as the reference implementation does.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same ops in the same order as below (bit-identical), in one call from Python.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings or 8192
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


# cos and sign-folded sin rows for a pass's positions, shaped [T, 1, D] to broadcast over heads.
Rope = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding:
    """Neox-style rotary embedding with a precomputed float32 cos/sin table indexed by position.

    A plain object, not a module: its tables are not weights, so moving or
    casting the model leaves them alone.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, device: torch.device) -> None:
        inv_freq = rope_inv_freq(rope, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        sin = emb.sin()
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_1, sin_2] exactly (negation is exact), and
        # the roll is one op where rotate_half is four.
        half = head_dim // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device)

    def lookup(self, positions: torch.Tensor) -> Rope:
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate every head of x: [T, heads, D] (neox style: the two halves of each head pair up)."""
    cos, sin_signed = rope
    if x.dtype == torch.float32:
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
    xf = x.float()
    return (xf * cos + xf.roll(xf.shape[-1] // 2, -1) * sin_signed).to(x.dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
