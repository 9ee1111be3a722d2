"""Mixture-of-experts architectures: Qwen2-MoE, Qwen3-MoE and Mixtral.

Each is the Llama decoder (llama.py: attention with QKV bias or q/k norm as configured, rotary,
RMSNorm) whose sparse layers (`MoEConfig.is_sparse`) have a `SparseMoeBlock` as their feed-forward:
a router, the layer's experts (experts.py) and, in Qwen2-MoE, a shared expert gated by a sigmoid.
Layers listed in `mlp_only_layers` (or skipped by `decoder_sparse_step`) keep the dense gated MLP of
`intermediate_size`; experts are `moe_intermediate_size` wide (Mixtral: `intermediate_size`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tandem.config import ModelConfig, MoEConfig
from tandem.model.attention import AttentionBackend
from tandem.model.direct_call import DirectCall
from tandem.model.experts import Experts, Router, route
from tandem.model.layers import GatedMLP, RotaryEmbedding
from tandem.model.llama import DecoderLayer, LlamaForCausalLM
from tandem.model.weights import Target

# model.layers.N.{mlp|block_sparse_moe}.experts.E.<projection>.weight (Qwen | Mixtral names)
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# Checkpoint projection -> (stacked parameter, shard of its rows: 0 gate, 1 up, None the whole).
_EXPERT_PROJ: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}
_SHARED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj)\.weight$")
_STACKED_RE = re.compile(r"^layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


class SparseMoeBlock(DirectCall, nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(moe.num_experts, hidden_size)
        self.experts: nn.Module = Experts(moe.num_experts, hidden_size, moe.expert_intermediate_size)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Router | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(1, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe)
        out: torch.Tensor = self.experts(x, ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs a mixture-of-experts config")
        self.moe: MoEConfig = cfg.moe
        super().__init__(cfg, backend, rotary)

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        if self.moe.is_sparse(index):
            return DecoderLayer(cfg, backend, mlp=SparseMoeBlock(cfg.hidden_size, self.moe))
        return DecoderLayer(cfg, backend)

    # Checkpoint mapping: each expert's projections go into the layer's stacked tensors.

    def fused_bounds(self) -> dict[str, list[int]]:
        shared = self.moe.shared_expert_intermediate_size
        return {**super().fused_bounds(), "mlp.shared_expert.gate_up_proj": [0, shared, 2 * shared]}

    def checkpoint_target(self, name: str) -> Target | None:
        m = _EXPERT_RE.match(name)
        if m and m.group(3) in _EXPERT_PROJ and int(m.group(2)) < self.moe.num_experts:
            layer, expert = m.group(1), int(m.group(2))
            param, shard = _EXPERT_PROJ[m.group(3)]
            target = f"layers.{layer}.mlp.experts.{param}"
            if shard is None:
                return Target(target, index=(expert,))
            size = self.moe.expert_intermediate_size
            return Target(target, index=(expert,), rows=(shard * size, (shard + 1) * size))
        if m:
            return Target(name)  # an expert this config does not have: refused as unexpected
        m = _SHARED_RE.match(name)
        if m:
            size = self.moe.shared_expert_intermediate_size
            shard = 0 if m.group(2) == "gate_proj" else 1
            return Target(
                f"layers.{m.group(1)}.mlp.shared_expert.gate_up_proj.weight",
                rows=(shard * size, (shard + 1) * size),
            )
        return super().checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))

    def param_parts(self, param: str) -> list[Target]:
        m = _STACKED_RE.match(param)
        if m is None:
            return super().param_parts(param)
        experts = range(self.moe.num_experts)
        if m.group(1) == "down_proj":
            return [Target(param, index=(e,)) for e in experts]
        size = self.moe.expert_intermediate_size
        return [Target(param, index=(e,), rows=(s * size, (s + 1) * size)) for e in experts for s in (0, 1)]
