"""Attention over a paged KV cache, and the registry of backends.

The `torch` backend works on any device. It writes the step's new K/V into the
cache through the slot mapping, then gathers each request's context from its
block table into a padded tensor and runs one `scaled_dot_product_attention`
per group of requests. Requests are grouped by query length in powers of two
(decodes, speculative verifications of a few tokens, prompt chunks), so a long
prefill does not pad every decode or verification to its length and padding
never more than doubles a group's queries. All index and
mask tensors are built once per step in `prepare` and shared by every layer,
so the per-layer work has no per-request Python.

Requests with a short query (decodes, speculative verifications), where Tandem's compiled kernels
are there (tandem/kernels), go to one `paged_attention` call per layer instead, which does the KV
write and the attention straight through the block tables: no gathered copy of the context, no
mask, no padding, and a dozen fewer torch operators per layer, which is most of a small-batch
step's attention cost on a CPU. In a step that also carries prompt chunks, only the chunks take
the grouped SDPA path; on a CPU with AVX-512 and no AMX (`kernel_takes_long_queries`) the kernel
takes the chunks too, and a step over an unquantized cache makes one attention call per layer.

A quantized KV cache (`kv_cache_dtype` int8 or fp8, tandem/model/kv_quant.py): new K/V are
quantized as they are written; the torch path dequantizes gathered rows to the model dtype, and
attention over a fresh prompt uses its own K/V as the cache will return them; short queries go to
the kernel's quantized variant (`paged_attention_quantized`), which widens each row and applies its
scale as it reads it.

Layers may differ from the backend's defaults (`LayerAttention`: Gemma's alternating sliding
windows, its attention scale and logit soft-capping). A model declares each variation with
`layer()` when it is built; `prepare` then builds one mask per distinct window, and each layer's
`forward` names its variation. Soft-capping changes the scores before the softmax, which neither
SDPA's fused kernels nor Tandem's kernel do: a backend with a soft-capped layer computes explicit
scores (as transformers' eager attention does) for those layers, and no layer takes the kernel.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.cpu import cpu_flags
from tandem.model.forward_batch import ForwardBatch
from tandem.model.kv_quant import KVCacheFormat

# Longest query (tokens per request in a step) the portable fused kernel takes where SDPA's blocked
# kernels are the better ones for prompt chunks (`kernel_takes_long_queries`). (The AMX kernel over a
# bfloat16 cache takes every query: a chunk's query tiles share one tiled layout of its context.)
FUSED_MAX_QUERY = 16


def kernel_takes_long_queries(flags: Set[str] | None = None) -> bool:
    """Whether the portable fused kernel also takes prompt chunks (queries of any length) on a CPU
    with `flags` (this one's when None): with AVX-512 and no AMX, where PyTorch's CPU SDPA runs a
    prompt's attention 1.07-3.2x slower than the kernel, bfloat16 and float32 alike (AMD EPYC kind,
    14 query heads on 2 KV heads of 64: 4 prompts of 32-128 tokens 2.2-3.2x, one of 512 1.8-2.1x,
    512 over 2048 1.3-1.5x, one of 2048 1.07-1.16x; benchmarks/paged_attention.py)."""
    f = cpu_flags() if flags is None else flags
    return "avx512f" in f and "amx_bf16" not in f


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer's attention differs from the backend's defaults."""

    sliding_window: int | None = None  # keys within this many positions of the query; None: all
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax
    scale: float | None = None  # None: head_dim ** -0.5


@dataclass(slots=True)
class _Paged:
    """Metadata of the fused kernel: the batch's layout as tensors, built once per step."""

    block_tables: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int64
    query_start_loc: torch.Tensor  # [B + 1] int64
    # In a batch that also has long queries: the flat token rows of the short-query requests the
    # kernel takes (query_start_loc then indexes into those rows), and their cache slots.
    rows: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    # The AMX tile kernel (paged_attention_amx), which takes queries of any length.
    tiles: bool = False


@dataclass(slots=True)
class _QueryGroup:
    q_index: torch.Tensor  # [G, Q] flat token index of each padded query slot
    kv_slots: torch.Tensor  # [G, C] cache slot of each padded key position
    mask: torch.Tensor | None  # [G, 1, Q, C] True where attention is allowed; None = causal, no context
    out_index: torch.Tensor  # [V] flat token index of each valid query slot
    valid: torch.Tensor | None  # [G, Q] which padded query slots are real; None when all are
    # Every token of the batch, in order, one per request (a pure decode batch): no gathers.
    whole_batch: bool = False
    # The masks of layers whose window is not the backend's default, by window.
    window_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend:
    name = "torch"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        use_kernel: bool | None = None,
        kv_format: KVCacheFormat | None = None,
        long_queries: bool | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        # None: the cache holds the model dtype (whatever the tensors passed in are).
        self.kv_format = kv_format if kv_format is not None and kv_format.quantized else None
        # use_kernel=False keeps the pure-torch path (tests); None takes the kernel where it built.
        op = "paged_attention" if self.kv_format is None else "paged_attention_quantized"
        self.fused = use_kernel is not False and kernels.has(op)
        # A bfloat16 cache on AMX: every query, prompt chunks too, in tiles (no window, head_dim 64/128).
        self.tiles = (
            self.fused
            and self.kv_format is None
            and kv_format is not None
            and kv_format.model_dtype == torch.bfloat16
            and head_dim in (64, 128)
            and sliding_window is None
            and kernels.has("paged_attention_amx")
            and bool(torch.ops.tandem.amx_ready())
        )
        # The kernel over an unquantized cache also takes prompt chunks: by the CPU rule when None.
        if long_queries is None:
            long_queries = kernel_takes_long_queries()
        self.max_fused_query = None if long_queries and self.kv_format is None else FUSED_MAX_QUERY
        # Windows of layers declared with `layer()` that differ from the default.
        self.other_windows: set[int | None] = set()

    def describe(self) -> str:
        """Which path each query takes, for the start-up log (after every layer was declared)."""
        if self.tiles:
            return "paged_attention_amx (AMX tiles), every query"
        if not self.fused:
            return "PyTorch SDPA over the gathered context"
        name = "paged_attention" if self.kv_format is None else "paged_attention_quantized"
        if self.max_fused_query is None:
            return f"{name} kernel, every query (AVX-512 without AMX: prompt chunks too)"
        return f"{name} kernel for queries up to {self.max_fused_query} tokens, SDPA for prompt chunks"

    def layer(self, spec: LayerAttention) -> LayerAttention:
        """Declare a layer's variation before the first pass; the layer passes it to `forward`."""
        if spec.sliding_window != self.sliding_window:
            self.other_windows.add(spec.sliding_window)
            self.tiles = False
        if spec.softcap is not None:
            self.fused = self.tiles = False
        return spec

    def prepare(self, batch: ForwardBatch) -> None:
        short = np.zeros(batch.num_requests, dtype=bool)
        # Requests verifying a draft tree need its mask: the grouped path (the kernels are causal).
        tree = _tree_requests(batch)
        if self.tiles and batch.input_ids.device.type == "cpu" and tree is None:
            batch.attn_metadata = self._paged(batch)
            batch.attn_metadata.tiles = True
            return
        if self.fused and batch.input_ids.device.type == "cpu":
            limit = self.max_fused_query
            short = np.ones(batch.num_requests, dtype=bool) if limit is None else batch.query_lens <= limit
            if tree is not None:
                short &= ~tree
            if short.all():
                batch.attn_metadata = self._paged(batch)
                return
        # Decodes and verifications that share a step with prompt chunks still take the kernel;
        # only the chunks go to SDPA (padding dozens of decodes to a group of their own took most
        # of such a step's attention time).
        groups: list[_QueryGroup | _Paged] = [self._paged(batch, np.flatnonzero(short))] if short.any() else []
        # Bucket b holds query lengths in (2^(b-1), 2^b]; decodes are bucket 0.
        rest = np.flatnonzero(~short)
        buckets = np.ceil(np.log2(np.maximum(batch.query_lens[rest], 1))).astype(np.int64)
        for b in np.unique(buckets):
            groups.append(self._group(batch, rest[buckets == b]))
        batch.attn_metadata = groups

    @staticmethod
    def _paged(batch: ForwardBatch, idx: np.ndarray | None = None) -> _Paged:
        """The kernel's metadata for the whole batch, or for the requests `idx` of a mixed one: then
        `rows` holds their tokens' rows in the flat batch, and query_start_loc indexes those rows."""
        sel = slice(None) if idx is None else idx
        qsl, rows, slots = batch.query_start_loc, None, None
        if idx is not None:
            q_lens = batch.query_lens[idx]
            qsl = np.zeros(idx.size + 1, dtype=np.int64)
            np.cumsum(q_lens, out=qsl[1:])
            # Row j of the subset is token j - qsl[i] of its request i, at that request's place.
            rows = torch.from_numpy(
                np.arange(int(qsl[-1])) + np.repeat(batch.query_start_loc[idx] - qsl[:-1], q_lens)
            )
            slots = batch.slot_mapping[rows]
        return _Paged(
            block_tables=torch.from_numpy(np.ascontiguousarray(batch.block_tables[sel], dtype=np.int64)),
            seq_lens=torch.from_numpy(np.ascontiguousarray(batch.seq_lens[sel], dtype=np.int64)),
            query_start_loc=torch.from_numpy(np.ascontiguousarray(qsl, dtype=np.int64)),
            rows=rows,
            slot_mapping=slots,
        )

    def _group(self, batch: ForwardBatch, idx: np.ndarray) -> _QueryGroup:
        device = batch.input_ids.device
        q_lens = batch.query_lens[idx]
        seq_lens = batch.seq_lens[idx]
        starts = batch.query_start_loc[idx]
        bs = batch.block_size
        # One fresh prompt with no cached context: plain causal attention on the new K/V.
        if idx.size == 1 and q_lens[0] == seq_lens[0] and self.sliding_window is None and batch.tree_bits is None:
            q_index = torch.arange(int(starts[0]), int(starts[0] + q_lens[0]), device=device)
            pos = np.arange(int(q_lens[0]))
            causal = pos[None, :] <= pos[:, None]
            masks = {w: torch.from_numpy(_windowed(causal, pos, pos, w)[None, None]).to(device) for w in self.other_windows}
            return _QueryGroup(q_index[None], torch.empty(0), None, q_index, None, window_masks=masks)
        max_q = int(q_lens.max())
        max_c = int(seq_lens.max())
        j = np.arange(max_q)
        q_valid = j[None, :] < q_lens[:, None]
        q_index = np.where(q_valid, starts[:, None] + j[None, :], starts[:, None])
        q_pos = (seq_lens - q_lens)[:, None] + j[None, :]
        k_pos = np.arange(max_c)
        k_valid = k_pos[None, :] < seq_lens[:, None]
        tables = batch.block_tables[idx]
        slots = tables[:, k_pos // bs] * bs + (k_pos % bs)[None, :]
        slots = np.where(k_valid, slots, 0)
        # Padded query slots sit past the sequence end, so they see every real key and never
        # produce an all-masked row (which would be NaN).
        causal = (k_pos[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
        if batch.tree_bits is not None:
            causal &= _tree_mask(batch, idx, q_index, q_pos, k_pos)
        mask = _windowed(causal, q_pos, k_pos, self.sliding_window)
        window_masks = {
            w: torch.from_numpy(_windowed(causal, q_pos, k_pos, w)[:, None]).to(device) for w in self.other_windows
        }
        all_valid = bool(q_valid.all())
        whole = max_q == 1 and idx.size == batch.num_requests == batch.num_tokens
        return _QueryGroup(
            whole_batch=whole,
            q_index=torch.from_numpy(q_index).to(device),
            kv_slots=torch.from_numpy(slots).to(device),
            mask=torch.from_numpy(mask[:, None]).to(device),
            out_index=torch.from_numpy(q_index[q_valid]).to(device),
            valid=None if all_valid else torch.from_numpy(q_valid).to(device),
            window_masks=window_masks,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        layer: LayerAttention | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, row] (row = D
        in the model dtype, or a quantized row of `kv_format`). `layer`: the calling layer's
        variation, as declared with `layer()`; None: the defaults."""
        scale, window, softcap = self.scale, self.sliding_window, None
        if layer is not None:
            scale = self.scale if layer.scale is None else layer.scale
            window, softcap = layer.sliding_window, layer.softcap
        meta = batch.attn_metadata
        fmt = self.kv_format
        if isinstance(meta, _Paged):  # never with a soft-cap: declaring one turns the kernel off
            if fmt is not None:
                k, v = fmt.quantize(k), fmt.quantize(v)
            return self._kernel(q, k, v, kv_cache, batch.slot_mapping, meta, scale, window)
        kvh, row = self.num_kv_heads, kv_cache.shape[-1]
        k_cache = kv_cache[0].view(-1, kvh, row)
        v_cache = kv_cache[1].view(-1, kvh, row)
        k_rows, v_rows = (k, v) if fmt is None else (fmt.quantize(k), fmt.quantize(v))
        k_cache.index_copy_(0, batch.slot_mapping, k_rows)
        v_cache.index_copy_(0, batch.slot_mapping, v_rows)
        if fmt is not None:  # from here on the step's own K/V are what later steps will read
            k, v = fmt.dequantize(k_rows, self.head_dim), fmt.dequantize(v_rows, self.head_dim)
        groups = batch.attn_metadata
        if len(groups) == 1 and isinstance(groups[0], _QueryGroup) and groups[0].whole_batch:
            g = groups[0]
            kg = self._gather(k_cache, g.kv_slots).transpose(1, 2)  # [T, KVH, C, D]
            vg = self._gather(v_cache, g.kv_slots).transpose(1, 2)
            o = _attend(q.unsqueeze(2), kg, vg, self._mask(g, window), scale, softcap)
            return o.squeeze(2)  # [T, H, D]
        out = torch.empty_like(q)
        for g in groups:
            if isinstance(g, _Paged):  # the short queries of a mixed batch (their K/V is written)
                r = g.rows
                assert g.slot_mapping is not None
                out[r] = self._kernel(q[r], k_rows[r], v_rows[r], kv_cache, g.slot_mapping, g, scale, window)
                continue
            if g.kv_slots.numel() == 0:  # fresh prompt: over its own K/V, causal unless windowed
                rows = g.out_index
                # 4-D inputs: with 3-D ones torch takes its unfused math path on CPU (~4x slower).
                o = _attend(
                    q[rows].transpose(0, 1)[None],
                    k[rows].transpose(0, 1)[None],
                    v[rows].transpose(0, 1)[None],
                    self._mask(g, window),
                    scale,
                    softcap,
                )
                out[rows] = o[0].transpose(0, 1)
                continue
            qg = q[g.q_index].transpose(1, 2)  # [G, H, Q, D]
            kg = self._gather(k_cache, g.kv_slots).transpose(1, 2)  # [G, KVH, C, D]
            vg = self._gather(v_cache, g.kv_slots).transpose(1, 2)
            o = _attend(qg, kg, vg, self._mask(g, window), scale, softcap).transpose(1, 2)  # [G, Q, H, D]
            out[g.out_index] = o.reshape(-1, *o.shape[2:]) if g.valid is None else o[g.valid]
        return out

    def _mask(self, g: _QueryGroup, window: int | None) -> torch.Tensor | None:
        return g.mask if window == self.sliding_window else g.window_masks[window]

    def _kernel(
        self,
        q: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        meta: _Paged,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """The fused kernel over these queries; k_rows, v_rows: their new K/V in the cache's format."""
        if meta.tiles:
            return torch.ops.tandem.paged_attention_amx(
                q, k_rows, v_rows, kv_cache, slots, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
            )
        args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window or 0)
        if self.kv_format is None:
            return torch.ops.tandem.paged_attention(q, k_rows, v_rows, kv_cache, slots, *args)
        fp8 = self.kv_format.kv_cache_dtype == "fp8_e4m3"
        return torch.ops.tandem.paged_attention_quantized(q, k_rows, v_rows, kv_cache, slots, *args, fp8)

    def _gather(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The rows of these slots in the model dtype: `[..., KVH, D]`."""
        rows = cache[slots]
        return rows if self.kv_format is None else self.kv_format.dequantize(rows, self.head_dim)


def _tree_requests(batch: ForwardBatch) -> np.ndarray | None:
    """Which requests verify a draft tree (some query token with a mask of its own), or None."""
    if batch.tree_bits is None:
        return None
    bits = batch.tree_bits.cpu().numpy()
    own = bits != -1
    qsl = batch.query_start_loc
    return np.array([bool(own[qsl[i] : qsl[i + 1]].any()) for i in range(batch.num_requests)])


def _tree_mask(
    batch: ForwardBatch, idx: np.ndarray, q_index: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray
) -> np.ndarray:
    """[G, Q, C]: False where a tree's query token may not see one of its request's query tokens
    (`ForwardBatch.tree_bits`; -1: every one); keys before the query tokens stay visible."""
    assert batch.tree_bits is not None
    bits = batch.tree_bits.cpu().numpy()[q_index]  # [G, Q]
    first = (batch.seq_lens[idx] - batch.query_lens[idx])[:, None, None]  # the first query token's key
    rel = k_pos[None, None, :] - first  # [G, 1, C]
    in_span = rel >= 0
    seen = (bits[:, :, None] >> np.clip(rel, 0, 63)) & 1
    return ~in_span | (seen != 0) | (bits[:, :, None] == -1)


def _windowed(causal: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """The causal mask [..., Q, C] (q_pos [..., Q], k_pos [C]) limited to `window` keys per query."""
    if window is None:
        return causal
    return causal & (k_pos[None, :] > q_pos[..., :, None] - window)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of q [G, H, Q, D] over k, v [G, KVH, C, D]; mask [G, 1, Q, C] (None: causal)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    # transformers' eager attention, in its order: scale, cap, mask, softmax in float32.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class AttentionBackend(Protocol):
    """What a model's layers need of an attention backend."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def layer(self, spec: LayerAttention) -> LayerAttention: ...

    def prepare(self, batch: ForwardBatch) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        layer: LayerAttention | None = None,
    ) -> torch.Tensor: ...


# The registry: "torch" (any device; Tandem's CPU kernels where they are built), "triton" (the
# GPU path's kernel, tandem/model/triton_backend.py) and "flashinfer" (where that package is
# installed, tandem/model/flashinfer_backend.py); the last two imported only when asked for.
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")


def get_attention_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None,
    kv_format: KVCacheFormat | None = None,
) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window, kv_format=kv_format)
    if name == "triton":
        try:
            from tandem.model.triton_backend import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"the triton attention backend needs Triton installed: {exc}") from None
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window, kv_format=kv_format)
    if name == "flashinfer":
        # Imports flashinfer itself: without it, a ValueError saying so (docs/gpu.md).
        from tandem.model.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window, kv_format=kv_format)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}")
