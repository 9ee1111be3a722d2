"""Building blocks of the decoder: RMSNorm, rotary embeddings, gated MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import RopeConfig
from tandem.model.direct_call import DirectCall
from tandem.model.rope import attention_scaling, rope_angles


class RMSNorm(DirectCall, nn.Module):
    # The compiled kernel instead of PyTorch's operators (tandem/model/fused_ops.py switches it on).
    fused = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() <= 3:
            return torch.ops.tandem.rms_norm(x, self.weight, self.eps, 0.0, True)
        # Computed in float32 whatever the weight dtype, as the reference implementation does.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same ops in the same order as below (bit-identical), in one call from Python.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a decoder layer's residual add and the norm after it,
        one pass over the rows with the kernel (the sum rounded to the dtype as PyTorch's add)."""
        if self.fused and x.dim() == 2 and residual.dtype == x.dtype:
            return torch.ops.tandem.add_rms_norm(x, residual, self.weight, self.eps, 0.0)
        total = residual + x
        return self.forward(total), total


# cos and sign-folded sin rows for a pass's positions, shaped [T, 1, D] to broadcast over heads.
Rope = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding:
    """Neox-style rotary embedding with a precomputed float32 cos/sin table indexed by position
    (tandem/model/rope.py computes each rope type's angles). With partial rotary the tables are
    narrower than a head: only its first `rotary_dim` elements rotate.

    A plain object, not a module: its tables are not weights, so moving or
    casting the model leaves them alone.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, device: torch.device) -> None:
        freqs = rope_angles(rope, head_dim, max_positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        scale = attention_scaling(rope)
        if scale != 1.0:  # yarn and longrope scale cos and sin (so q.k by scale squared)
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(device)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_1, sin_2] exactly (negation is exact), and
        # the roll is one op where rotate_half is four.
        half = emb.shape[-1] // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device)

    def lookup(self, positions: torch.Tensor) -> Rope:
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate every head of x: [T, heads, D] (neox style: the two halves of each head pair up)."""
    cos, sin_signed = rope
    if cos.shape[-1] != x.shape[-1]:  # partial rotary: the rest of each head passes through
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], rope), x[..., rot:]), dim=-1)
    if x.dtype == torch.float32:
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
    xf = x.float()
    return (xf * cos + xf.roll(xf.shape[-1] // 2, -1) * sin_signed).to(x.dtype)


def rotate(x: torch.Tensor, rope: Rope, fused: bool) -> torch.Tensor:
    """apply_rope, or with `fused` the compiled kernel rotating x [T, heads, D] in place (x may be
    a view of the projection's output: nothing else reads it)."""
    if not fused:
        return apply_rope(x, rope)
    torch.ops.tandem.rope_(x, *rope)
    return x


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The `hidden_act` / `hidden_activation` names of config.json, as transformers' ACT2FN maps them.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class GatedMLP(DirectCall, nn.Module):
    # SiLU-and-multiply in one compiled call (tandem/model/fused_ops.py switches it on for SiLU),
    # or inside the gate/up product where its layer can (`gate_up_silu`: tandem/model/gate_up.py).
    fused = False
    gate_up_silu: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        self.intermediate = intermediate
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            fused_product = self.gate_up_silu
            if fused_product is not None:
                return self.down_proj(fused_product(x))
            return self.down_proj(torch.ops.tandem.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
