"""Rotary embedding angles for each rope type, one row per position, as transformers computes them
(`ROPE_INIT_FUNCTIONS` in modeling_rope_utils.py): default, linear, llama3, yarn, longrope, dynamic,
with partial rotary (`partial_rotary_factor`: only the first part of each head rotates).

Two types depend on the sequence length in transformers, which decides per forward pass:

- `dynamic` (NTK) raises the base once a pass reaches past max_position_embeddings, from the pass's
  largest position, and keeps the keys already cached as they were rotated. Tandem rotates each
  token once, when its key is written, with the frequencies transformers uses for a pass that ends
  at that token's position. So a request whose prompt fits in max_position_embeddings matches
  transformers exactly, through every decode step (those past the length too: transformers
  decodes them one position per pass), and a key depends on its position alone, never on
  batching, chunking or other requests, which the prefix cache and recompute preemption rely on.
  A longer prompt is where the two differ: transformers rotates the whole prompt with the base for
  its full length, Tandem each prompt position with its own. (vLLM uses one base for every
  position, that of max_position_embeddings x factor, which differs from transformers even for
  short requests.)
- `longrope` uses its short factors while a sequence is within original_max_position_embeddings and
  its long factors past it; Phi-3's generate recomputes the whole cache with the long factors at the
  switch. Tandem picks one set for the engine, as vLLM does: the long factors when max_model_len
  exceeds the original length, the short ones otherwise. With the short set every request matches
  transformers; with the long set, a request whose prompt is past the original length matches it,
  one that is shorter does not (transformers would use the short factors until it crossed).
"""

from __future__ import annotations

import math

import torch

from tandem.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def rope_inv_freq(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """The inverse frequencies of the rotating dimensions [rotary_dim / 2]. For longrope, its short
    factors (or with `long`, its long ones); for dynamic, those within max_position_embeddings."""
    dim = rotary_dim(rope, head_dim)
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != dim // 2:
            name = "long_factor" if long else "short_factor"
            raise ValueError(f"rope {name} has {len(factors)} entries, expected {dim // 2} (rotary dim / 2)")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** _exponents(dim))
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    inv_freq = 1.0 / (rope.theta ** _exponents(dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings or rope.max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Interpolated (divided by `factor`) below a band of dimensions, untouched above it, a linear
    ramp across it; the band is where the original length holds beta_slow to beta_fast turns."""
    original = rope.original_max_position_embeddings or rope.max_position_embeddings

    def correction_dim(turns: float) -> float:
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(rope.theta))

    low: float = correction_dim(rope.beta_fast)
    high: float = correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a band of one dimension: avoid dividing by zero
    pos_freqs = rope.theta ** _exponents(dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def attention_scaling(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by (yarn's mscale, longrope's attention factor)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.mscale and rope.mscale_all_dim:
            return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
        return mscale(rope.factor)
    if rope.rope_type == "longrope" and rope.factor > 1.0:
        original = rope.original_max_position_embeddings or rope.max_position_embeddings
        return math.sqrt(1 + math.log(rope.factor) / math.log(original))
    return 1.0


def rope_angles(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """Rotation angles [max_positions, rotary_dim / 2]: position times inverse frequency, for an
    engine whose sequences reach `max_positions` tokens (see the module docstring for the types
    that depend on the length)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    long = rope.rope_type == "longrope" and max_positions > (
        rope.original_max_position_embeddings or rope.max_position_embeddings
    )
    inv_freq = rope_inv_freq(rope, head_dim, long=long)
    angles = t[:, None] * inv_freq[None, :]
    if rope.rope_type == "dynamic" and max_positions > rope.max_position_embeddings:
        start = rope.max_position_embeddings
        dim = rotary_dim(rope, head_dim)
        # The NTK base for a pass whose sequence ends at each position (its length = position + 1).
        seq_len = torch.arange(start + 1, max_positions + 1, dtype=torch.int64)
        base = rope.theta * ((rope.factor * seq_len / start) - (rope.factor - 1)) ** (dim / (dim - 2))
        long_inv = 1.0 / (base[:, None] ** _exponents(dim)[None, :])
        angles[start:] = t[start:, None] * long_inv
    return angles
