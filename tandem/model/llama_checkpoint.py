"""The Llama family's checkpoint layout: separate q/k/v and gate/up projections in the checkpoint,
loaded as row shards of the model's fused qkv_proj and gate_up_proj (Gemma's checkpoints share it)."""

from __future__ import annotations

import re
from itertools import pairwise

from torch import nn

from tandem.config import ModelConfig
from tandem.model.weights import Target

# Checkpoint projection -> (our fused parameter, shard index within it).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class LlamaCheckpointMapping:
    """tandem.model.weights.WeightMapping for a model with `config` and `lm_head` (None when tied)."""

    config: ModelConfig
    lm_head: nn.Module | None

    def fused_bounds(self) -> dict[str, list[int]]:
        """Row boundaries of each fused parameter's shards, by parameter suffix."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {
            "self_attn.qkv_proj": [0, q, q + kv, q + 2 * kv],
            "mlp.gate_up_proj": [0, cfg.intermediate_size, 2 * cfg.intermediate_size],
        }

    def checkpoint_target(self, name: str) -> Target | None:
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied embeddings: some checkpoints store the copy anyway
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _FUSED:
            fused, shard = _FUSED[m.group(2)]
            bounds = self.fused_bounds()[fused]
            return Target(
                f"layers.{m.group(1)}.{fused}.{m.group(3)}", rows=(bounds[shard], bounds[shard + 1])
            )
        return Target(name.removeprefix("model."))

    def param_parts(self, param: str) -> list[Target]:
        for fused, bounds in self.fused_bounds().items():
            if f".{fused}." in param:
                return [Target(param, rows=(a, b)) for a, b in pairwise(bounds)]
        return [Target(param)]
