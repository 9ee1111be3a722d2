"""The batch metadata one forward pass reads.

It lives with the model because attention reads it; the worker only builds it.
Every token scheduled this step, from every request, is one row of a flat
ragged batch; per-request structure is carried by offsets and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] token ids, all requests concatenated
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] KV slot (block_id * block_size + offset) each token writes
    logits_indices: torch.Tensor  # [S] rows of the flat batch whose next-token logits are needed
    # Host-side per-request layout, for attention backends to build their metadata from.
    query_start_loc: np.ndarray  # [B + 1] offsets of each request's tokens in the flat batch
    query_lens: np.ndarray  # [B] tokens computed this step per request
    seq_lens: np.ndarray  # [B] context length per request after this step
    block_tables: np.ndarray  # [B, max_blocks] block ids, padded with 0
    block_size: int
    # Filled by the attention backend's `prepare`, read by its `forward` in every layer.
    attn_metadata: Any = None
    # [T] int64, a tree verification's mask (backends that take one): bit i of a token's word lets
    # it see its request's i-th query token; None: causal.
    tree_bits: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.query_lens.shape[0])
