"""Mixture-of-experts feed-forward: the router and the batched expert path.

Routing (as transformers computes it): router logits in the model's dtype, a float32 softmax over
all experts, the `top_k` largest probabilities per token, divided by their sum where
`norm_topk_prob` (MoEConfig). The router and Qwen2-MoE's shared-expert gate are `Router`s, not
`nn.Linear`, so neither oneDNN packing nor int8 quantization touches them: routing decisions stay
as the checkpoint makes them.

Expert path (`run_experts`), for a step's flat batch of T tokens:
- one token (a single stream's decode): its `top_k` experts in turn, each product reading only that
  expert's weights, no sorting or scattering;
- more: the T * top_k (token, expert) pairs are sorted by expert once per layer, the token rows
  gathered into that order, one gate/up and one down product per expert that received tokens,
  over its contiguous slice, then the outputs are weighted and scatter-added back to their tokens
  (`index_add_`, accumulated in float32). No Python loop runs over tokens.

Each product goes through `Experts.expert_mlp`: float experts use the stored weight slice
(`linear.plain_product`: Tandem's few-row kernel where it built, MKL otherwise); int8 experts
(`quantization="int8"`) are one `Int8Linear` per expert and projection, with its row-count paths.

Why this path and not a gathered bmm, token-by-token products, `torch._grouped_mm` or
oneDNN-packed experts: the measurements are in docs/moe.md ("Measured choice").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import MoEConfig
from tandem.model.linear import plain_product

logger = logging.getLogger("tandem.model")

# Tokens up to which each token runs its experts in turn (no sort, gather or scatter); above it the
# pairs are grouped by expert. Measured: benchmarks/moe_experts.py.
DIRECT_MAX_TOKENS = 1


class Router(nn.Module):
    """`x @ weight.T` (router logits, or the shared-expert gate's logit), kept out of packing and
    quantization so that routing stays in the model's own precision."""

    def __init__(self, outputs: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, top_k], expert ids [T, top_k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not moe.float32_routing_weights:
        weights = weights.to(logits.dtype)
    return weights, ids


class ExpertMLPs(Protocol):
    num_experts: int
    hidden_size: int

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s gated MLP over rows x [n, hidden] -> [n, hidden], in x's dtype."""
        ...


def run_experts(
    experts: ExpertMLPs, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t: x [T, H] -> [T, H]."""
    tokens, top_k = ids.shape
    if 0 < tokens <= DIRECT_MAX_TOKENS:
        return _token_by_token(experts, x, ids, weights)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    token_of = order // top_k
    rows = x.index_select(0, token_of)
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            out_rows[start : start + n] = experts.expert_mlp(expert, rows[start : start + n])
            start += n
    weighted = out_rows.float() * weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros((tokens, experts.hidden_size), dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, weighted)
    return out.to(x.dtype)


def _token_by_token(
    experts: ExpertMLPs, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros((x.shape[0], experts.hidden_size), dtype=torch.float32, device=x.device)
    ids_list, weight_list = ids.tolist(), weights.float().tolist()
    for t, (token_ids, token_weights) in enumerate(zip(ids_list, weight_list)):
        acc = out[t : t + 1]
        for expert, w in zip(token_ids, token_weights):
            acc += experts.expert_mlp(expert, x[t : t + 1]).float() * w
    return out.to(x.dtype)


def _gated(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Experts(nn.Module):
    """One layer's experts, stacked: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up
    rows) and down_proj [E, H, I], as checkpoints fill them expert by expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self._product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
        self._product_dtype: torch.dtype | None = None
        # Tandem's CPU kernels for few-row products where they built; False (the GPU path, and
        # any weights off the CPU): F.linear always.
        self.cpu_kernels = True

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self._product_dtype != self.gate_up_proj.dtype:  # chosen once the weights have their dtype
            kernels_here = self.cpu_kernels and self.gate_up_proj.device.type == "cpu"
            self._product = plain_product(self.gate_up_proj.dtype) if kernels_here else F.linear
            self._product_dtype = self.gate_up_proj.dtype
        h = _gated(self._product(x, self.gate_up_proj[expert]))
        return self._product(h, self.down_proj[expert])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, ids, weights)


class Int8Experts(nn.Module):
    """The same experts with int8 weights: one `Int8Linear` per expert and projection."""

    def __init__(self, experts: Experts, use_kernel: bool | None = None) -> None:
        from tandem.model.quant import Int8Linear

        super().__init__()
        self.num_experts, self.hidden_size = experts.num_experts, experts.hidden_size
        self.gate_up = nn.ModuleList(
            Int8Linear(w, None, use_kernel) for w in experts.gate_up_proj.detach().unbind(0)
        )
        self.down = nn.ModuleList(Int8Linear(w, None, use_kernel) for w in experts.down_proj.detach().unbind(0))

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.down[expert](_gated(self.gate_up[expert](x)))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, ids, weights)


def prepare_experts(model: nn.Module, quantization: str | None, use_kernel: bool | None = None) -> None:
    """After loading: int8 experts under `quantization="int8"`, and a start-up line saying which
    expert path runs and what the experts weigh."""
    parents = [m for m in model.modules() if isinstance(getattr(m, "experts", None), Experts)]
    if not parents:
        return
    stacked = [p.experts for p in parents if isinstance(p.experts, Experts)]
    first = stacked[0]
    layers: list[nn.Module] = list(stacked)
    if quantization == "int8":
        layers = []
        for parent, experts in zip(parents, stacked):
            parent.experts = Int8Experts(experts, use_kernel)
            layers.append(parent.experts)
    nbytes = sum(t.numel() * t.element_size() for m in layers for t in [*m.parameters(), *m.buffers()])
    what = "int8 (one scale per output channel)" if quantization == "int8" else str(first.gate_up_proj.dtype)
    logger.info(
        "MoE: %d layers of %d experts, weights in %s, %.2f GiB; one token runs its experts in turn, "
        "more are grouped by expert",
        len(layers),
        first.num_experts,
        what,
        nbytes / 2**30,
    )
