"""FlashInfer's page table and masks, computed from Tandem's batch layout (pure functions).

FlashInfer's paged wrappers (tandem/model/flashinfer_backend.py) take the KV cache as a CSR page
table: for request b, its pages are `kv_indices[kv_indptr[b]:kv_indptr[b + 1]]` in order, the last
one holding `kv_last_page_len[b]` (1..page_size) tokens, so its context length is
`(pages - 1) * page_size + last`; its query rows are `qo_indptr[b]:qo_indptr[b + 1]` of the flat
batch, the last of them at the context's last position (causal attention is aligned to the end).
Tandem's block tables are that table padded to a rectangle: request b's first
`ceil(seq_len / block_size)` entries, and a page is a block.

A custom mask (FlashInfer's alternative to `causal`, used here for tree verification) is one
boolean matrix [q_len, kv_len] per request, row-major, flattened and concatenated in request
order; True lets the query row see the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class PagePlan:
    qo_indptr: np.ndarray  # [B + 1] int32
    kv_indptr: np.ndarray  # [B + 1] int32
    kv_indices: np.ndarray  # [kv_indptr[-1]] int32, block ids
    kv_last_page_len: np.ndarray  # [B] int32, 1..block_size
    decode_only: bool  # every request has one query token (FlashInfer's decode wrapper takes it)


def plan_pages(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int
) -> PagePlan:
    """The page table of a step: each request's used blocks, in order, from its padded row."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    tables = np.asarray(block_tables)
    query_lens = np.diff(qsl)
    if lens.shape != query_lens.shape or (lens.size and tables.shape[0] != lens.size):
        raise ValueError(
            f"plan_pages: {query_lens.size} requests by query_start_loc, {lens.size} by seq_lens, "
            f"{tables.shape[0]} block table rows"
        )
    if (query_lens < 1).any() or (lens < query_lens).any():
        raise ValueError("plan_pages: every request needs a query token and seq_len >= its query length")
    pages = -(-lens // block_size)
    width = tables.shape[1] if tables.ndim == 2 else 0
    if pages.size and int(pages.max()) > width:
        raise ValueError(f"plan_pages: a request needs {int(pages.max())} blocks, its table has {width}")
    used = np.arange(width)[None, :] < pages[:, None]
    return PagePlan(
        qo_indptr=qsl.astype(np.int32),
        kv_indptr=np.concatenate([[0], np.cumsum(pages)]).astype(np.int32),
        kv_indices=tables.reshape(len(lens), width)[used].astype(np.int32),
        kv_last_page_len=(lens - (pages - 1) * block_size).astype(np.int32),
        decode_only=bool((query_lens == 1).all()),
    )


def custom_mask(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    tree_bits: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """FlashInfer's flattened custom mask for a step with a tree verification, with the Triton
    kernel's semantics (tandem/kernels/triton_attention.py): causal, within `window` positions,
    and a query token with tree word w sees the request's i-th query token only where bit i of w
    is set (w = -1: every one); the context before the query tokens is always visible.
    tree_bits [T] int64, on the device the mask is made on."""
    device = tree_bits.device
    masks = []
    start = 0
    for q_len, kv_len in zip(np.asarray(query_lens).tolist(), np.asarray(seq_lens).tolist()):
        ctx = kv_len - q_len
        words = tree_bits[start : start + q_len]
        start += q_len
        q_pos = ctx + torch.arange(q_len, device=device)
        k_idx = torch.arange(kv_len, device=device)
        allowed = k_idx[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_idx[None, :] > q_pos[:, None] - window
        rel = k_idx - ctx
        shift = rel.clamp(0, 63)
        bit = ((words[:, None] >> shift[None, :]) & 1).bool()
        allowed &= (rel < 0)[None, :] | bit | (words == -1)[:, None]
        masks.append(allowed.reshape(-1))
    return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool, device=device)
