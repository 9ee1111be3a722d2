"""What the worker needs from a model, whatever its architecture."""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.config import ModelConfig
from tandem.model.attention import AttentionBackend
from tandem.model.forward_batch import ForwardBatch
from tandem.model.layers import RotaryEmbedding
from tandem.model.weights import Target


class CausalLM(Protocol):
    config: ModelConfig
    # The attention backend every layer shares: the runner prepares it once per pass.
    backend: AttentionBackend

    def __call__(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states after the final norm, one row per token of the flat batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    # The checkpoint mapping (tandem.model.weights.WeightMapping).
    def checkpoint_target(self, name: str) -> Target | None: ...

    def param_parts(self, param: str) -> list[Target]: ...


class CausalLMClass(Protocol):
    def __call__(
        self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding
    ) -> CausalLM: ...
