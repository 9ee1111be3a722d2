"""Preemption by swap or by recompute: which one costs a victim less.

A request preempted by recompute frees its KV blocks and, when resumed, computes its tokens again (a
prefill of everything it had computed). One preempted by swap has its blocks copied to host memory
(the swap space) and, when resumed, copied back into fresh blocks: its computed tokens stay computed.
Swap costs the bytes of the blocks it moves, out and back, over the host link; recompute costs the
prefill's FLOPs. The scheduler asks `PreemptionCost.swaps` for each victim; the constants behind it
(the link's bandwidth, the prefill's FLOP rate) are engine arguments, their defaults documented in
docs/defaults.md. Pure Python: the engine fills the model's numbers in (`model_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

AUTO, SWAP, RECOMPUTE = "auto", "swap", "recompute"
# `preemption_mode` (vLLM's name): by cost, always swap (where the swap space has room), never swap.
PREEMPTION_MODES = (AUTO, SWAP, RECOMPUTE)


class ModelShape(Protocol):
    """What the FLOP count reads of a model's config (tandem.config.ModelConfig)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def model_flops(mc: ModelShape) -> tuple[float, float]:
    """A forward's FLOPs: per token through the linear layers (2 per weight it multiplies; a
    mixture of experts counts the experts a token is routed to, not all of them; the LM head is
    left out, as a prefill runs it on one row per request), and per (query, key) pair in attention
    (QK^T and PV, 2 each per head dimension, every layer)."""
    h, d, layers = mc.hidden_size, mc.head_dim, mc.num_layers
    attn = h * mc.num_heads * d * 2 + h * mc.num_kv_heads * d * 2  # q and o; k and v
    moe = getattr(mc, "moe", None)
    mlp = 0
    for layer in range(layers):
        if moe is not None and moe.is_sparse(layer):
            mlp += 3 * h * (moe.top_k * moe.expert_intermediate_size + moe.shared_expert_intermediate_size)
        else:
            mlp += 3 * h * mc.intermediate_size
    return 2.0 * (layers * attn + mlp), 4.0 * layers * mc.num_heads * d


@dataclass(frozen=True, slots=True)
class PreemptionCost:
    """Swap or recompute, for one victim, by the seconds each takes (the model's numbers from
    `model_flops`, the machine's from the engine's arguments)."""

    # Bytes of one KV block over every layer (K and V, scales included): what a swap moves.
    block_bytes: int
    linear_flops_per_token: float
    attention_flops_per_pair: float
    # The host link's bandwidth (bytes/s, each way) and the FLOP rate a prefill reaches.
    link_bytes_per_s: float
    flops_per_s: float
    mode: str = AUTO

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.mode!r}")
        if not (self.link_bytes_per_s > 0 and self.flops_per_s > 0):
            raise ValueError("the swap link's bandwidth and the recompute FLOP rate must be positive")

    def swap_seconds(self, num_blocks: int) -> float:
        """Copying `num_blocks` blocks out to host memory and back."""
        return 2 * num_blocks * self.block_bytes / self.link_bytes_per_s

    def recompute_seconds(self, start: int, end: int) -> float:
        """Computing positions [start, end) again, each attending to every position up to its own."""
        pairs = (end * (end + 1) - start * (start + 1)) // 2
        flops = (end - start) * self.linear_flops_per_token + pairs * self.attention_flops_per_pair
        return flops / self.flops_per_s

    def swaps(self, num_blocks: int, start: int, end: int) -> bool:
        """Whether a victim that would move `num_blocks` blocks, or else compute positions
        [start, end) again, goes by swap."""
        if self.mode != AUTO:
            return self.mode == SWAP
        return self.swap_seconds(num_blocks) < self.recompute_seconds(start, end)
