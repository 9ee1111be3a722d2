"""The `triton` attention backend: the GPU path's attention (`--attention-backend triton`).

Each layer writes the step's K/V into the paged cache through the slot mapping, then one Triton
kernel (tandem/kernels/triton_attention.py) attends every query token of the step (decodes,
verifications, prompt chunks over their cached prefix) straight through the block tables. The
batch's layout goes to the device once per step in `prepare`; the kernel reads each layer's
window, scale and soft-cap from the layer's declaration. A step may carry a tree mask for
speculative verification (`ForwardBatch.tree_bits`).

The same code runs on CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`), which is
how the test suite runs the GPU path's model code without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.model.attention import LayerAttention
from tandem.model.forward_batch import ForwardBatch
from tandem.model.kv_quant import KVCacheFormat


@dataclass(slots=True)
class _Layout:
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    tree_bits: torch.Tensor | None


class TritonAttentionBackend:
    name = "triton"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        kv_format: KVCacheFormat | None = None,
    ) -> None:
        if kv_format is not None and kv_format.quantized:
            raise ValueError(
                f"the triton attention backend takes kv_cache_dtype 'auto' only, got {kv_format.kv_cache_dtype!r}"
            )
        from tandem.kernels.triton_attention import paged_attention

        self._attend = paged_attention
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def layer(self, spec: LayerAttention) -> LayerAttention:
        return spec

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device

        def put(values: object) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        batch.attn_metadata = _Layout(
            block_tables=put(batch.block_tables),
            seq_lens=put(batch.seq_lens),
            query_start_loc=put(batch.query_start_loc),
            max_query_len=int(batch.query_lens.max()) if batch.num_requests else 0,
            max_seq_len=int(batch.seq_lens.max()) if batch.num_requests else 0,
            tree_bits=batch.tree_bits,
        )

    @staticmethod
    def static_layout(
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
    ) -> _Layout:
        """A layout over device buffers that stay in place from step to step (CUDA graphs,
        tandem/worker/cuda_graphs.py): nothing is read back to the host, and `max_seq_len` is a
        bound (the model's length), not the batch's longest context."""
        return _Layout(block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, None)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        layer: LayerAttention | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]."""
        scale, window, softcap = self.scale, self.sliding_window, None
        if layer is not None:
            scale = self.scale if layer.scale is None else layer.scale
            window, softcap = layer.sliding_window, layer.softcap
        kvh, d = self.num_kv_heads, kv_cache.shape[-1]
        kv_cache[0].view(-1, kvh, d).index_copy_(0, batch.slot_mapping, k)
        kv_cache[1].view(-1, kvh, d).index_copy_(0, batch.slot_mapping, v)
        meta: _Layout = batch.attn_metadata
        return self._attend(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            window=window,
            softcap=softcap,
            tree_bits=meta.tree_bits,
            max_seq_len=meta.max_seq_len,
        )
