"""The `flashinfer` attention backend (`--attention-backend flashinfer`): FlashInfer's paged-KV
kernels, the library vLLM and SGLang use, where the package is installed. Never required: without
it the name is a ValueError (tandem/worker/device.py, and here for a direct caller).

The KV cache needs no conversion: Tandem's per-layer cache [2, num_blocks, block_size, KVH, D]
gives K and V as two [num_blocks, block_size, KVH, D] views, which is FlashInfer's "NHD" layout
with separate K and V (its `(k_cache, v_cache)` form), and a block is a page. Each step `prepare`
turns the block tables into FlashInfer's page table (tandem/model/flashinfer_plan.py, a pure
function); each wrapper is planned once per step, at the first layer that needs it (the query's
dtype is known there), and every layer of that kind reuses the plan.

Which wrapper: a step in which every request decodes one token takes
`BatchDecodeWithPagedKVCacheWrapper`; any other step (prompt chunks over cached prefixes, draft
verification, mixed steps) takes `BatchPrefillWithPagedKVCacheWrapper` for the whole batch, which
takes one-token queries as well. A tree verification (`ForwardBatch.tree_bits`) passes the tree as
FlashInfer's custom mask, for every request of the step (the Triton kernel's semantics).

Layers that differ (Gemma's alternating windows, its soft-cap and scale: `LayerAttention`) get a
wrapper each, since FlashInfer takes them at plan time. A sliding window of w positions (keys with
position > query - w) is FlashInfer's `window_left = w - 1`.

Not done: CUDA graphs (the wrappers would need `use_cuda_graph` and fixed buffers; a FlashInfer
engine runs its decode batches eagerly, tandem/worker/device.py), and quantized KV caches.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from tandem.model.attention import LayerAttention
from tandem.model.flashinfer_plan import PagePlan, custom_mask, plan_pages
from tandem.model.forward_batch import ForwardBatch
from tandem.model.kv_quant import KVCacheFormat

# FlashInfer's recommended float workspace (split-K partial results), one per device, shared by
# the wrappers (they run one after another on the stream).
WORKSPACE_BYTES = 128 << 20
# Query heads per KV head from which the decode wrapper uses tensor cores (vLLM's choice).
TENSOR_CORE_GROUP = 4

# (window, soft-cap, scale) of a layer kind: one planned wrapper each per step.
_Key = tuple[int | None, float | None, float]


@dataclass(slots=True)
class _Step:
    plan: PagePlan
    tensors: dict[str, torch.Tensor]
    tree_bits: torch.Tensor | None
    query_lens: Any
    seq_lens: Any
    planned: dict[_Key, Any] = field(default_factory=dict)


def import_flashinfer() -> ModuleType:
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ValueError(
            "attention_backend='flashinfer' needs the flashinfer package, which is not importable "
            f"({exc}); 'triton' (the default on CUDA) needs nothing more"
        ) from None


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        kv_format: KVCacheFormat | None = None,
        flashinfer: ModuleType | None = None,
    ) -> None:
        if kv_format is not None and kv_format.quantized:
            raise ValueError(
                f"the flashinfer attention backend takes kv_cache_dtype 'auto' only, got {kv_format.kv_cache_dtype!r}"
            )
        self._fi = import_flashinfer() if flashinfer is None else flashinfer
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self._workspace: torch.Tensor | None = None
        # (decode?, key) -> wrapper, made once and planned again every step.
        self._wrappers: dict[tuple[bool, _Key], Any] = {}

    def layer(self, spec: LayerAttention) -> LayerAttention:
        return spec

    def _key(self, layer: LayerAttention | None) -> _Key:
        if layer is None:
            return (self.sliding_window, None, self.scale)
        return (layer.sliding_window, layer.softcap, self.scale if layer.scale is None else layer.scale)

    def prepare(self, batch: ForwardBatch) -> None:
        plan = plan_pages(batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.block_size)
        if batch.tree_bits is not None:
            plan = PagePlan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, False)
        # Host tensors: plan() reads the indptrs on the host and copies what the kernels need.
        tensors = {
            "qo_indptr": torch.from_numpy(plan.qo_indptr),
            "kv_indptr": torch.from_numpy(plan.kv_indptr),
            "kv_indices": torch.from_numpy(plan.kv_indices),
            "kv_last_page_len": torch.from_numpy(plan.kv_last_page_len),
        }
        batch.attn_metadata = _Step(plan, tensors, batch.tree_bits, batch.query_lens, batch.seq_lens)

    def _wrapper(self, decode: bool, key: _Key, device: torch.device) -> Any:
        wrapper = self._wrappers.get((decode, key))
        if wrapper is None:
            if self._workspace is None or self._workspace.device != device:
                self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            if decode:
                wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    "NHD",
                    use_tensor_cores=self.num_heads // self.num_kv_heads >= TENSOR_CORE_GROUP,
                )
            else:
                wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._wrappers[(decode, key)] = wrapper
        return wrapper

    def _plan(self, step: _Step, key: _Key, dtype: torch.dtype, device: torch.device, block_size: int) -> Any:
        window, softcap, scale = key
        decode = step.plan.decode_only
        wrapper = self._wrapper(decode, key, device)
        t = step.tensors
        common: dict[str, Any] = dict(
            window_left=-1 if window is None else window - 1,
            logits_soft_cap=softcap,
            sm_scale=scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, block_size)
        if decode:
            wrapper.plan(t["kv_indptr"], t["kv_indices"], t["kv_last_page_len"], *heads, **common)
        else:
            mask = None
            if step.tree_bits is not None:
                mask = custom_mask(step.query_lens, step.seq_lens, step.tree_bits, window)
            wrapper.plan(
                t["qo_indptr"],
                t["kv_indptr"],
                t["kv_indices"],
                t["kv_last_page_len"],
                *heads,
                causal=mask is None,
                custom_mask=mask,
                **common,
            )
        step.planned[key] = wrapper
        return wrapper

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
        kvh, d = self.num_kv_heads, kv_cache.shape[-1]
        kv_cache[0].view(-1, kvh, d).index_copy_(0, batch.slot_mapping, k)
        kv_cache[1].view(-1, kvh, d).index_copy_(0, batch.slot_mapping, v)
        step: _Step = batch.attn_metadata
        key = self._key(layer)
        wrapper = step.planned.get(key)
        if wrapper is None:
            wrapper = self._plan(step, key, q.dtype, q.device, kv_cache.shape[2])
        out: torch.Tensor = wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]))
        return out
