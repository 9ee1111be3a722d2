"""Attention over a paged KV cache, in Triton: the GPU path's kernel (the CPU path has its C++ ones).

One kernel serves every query shape a step holds: decodes (one query token), speculative
verifications (a few, chained or a tree), and prompt chunks over their request's cached prefix.
A program takes one KV head and a block of query rows that share it: `BLOCK_Q` query tokens of
one request times the `QPK` query heads of that KV head (grouped-query attention reads each K/V
tile once for all of them). It walks the request's context in tiles of `TILE_N` positions,
looking each position's block up in the block table (so the tile does not depend on the cache's
block size), with an online softmax (FlashAttention's running max and sum).

Long contexts with few query rows (decode batches of a few long requests) leave most of a GPU idle
with one program per (request, KV head): `num_splits` > 1 splits the context among programs
(split-K, FlashDecoding's idea), each writing its partial sum, max and normalizer, and a second
kernel combines them.

Masks: causal by position in the sequence; a sliding window (`window`: keys within that many
positions); logit soft-capping (`softcap`, Gemma 2); and for tree verification a per-query-token
bitmask of the query tokens it may see (`tree_bits`: bit i = the request's i-th query token; -1
for a token outside every tree, whatever its query's length), all its context before the query
tokens being visible.

Runs on CUDA, and on CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`), which is how
the test suite checks it against a torch reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Query rows a program takes at least (tl.dot's smallest tile), and the context positions a tile holds.
MIN_BLOCK_M = 16
TILE_N = 32
# The tree mask's bits: at most this many query tokens in a tree verification (a token outside
# every tree has all bits set, -1, and any number of query tokens).
MAX_TREE_TOKENS = 64


@triton.jit
def _attend_tiles(
    q, m_i, l_i, acc,
    k_ptr, v_ptr, table_ptr,
    seq_len, context_len, q_idx, rows_ok, tree,
    tile_lo, tile_hi, kv_head,
    scale, softcap, window,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    KV_BLOCK: tl.constexpr, TILE: tl.constexpr, HEAD_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, TREE: tl.constexpr, IEEE: tl.constexpr,
):
    """The online softmax over context tiles [tile_lo, tile_hi) for a block of query rows."""
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD_DIM
    for t in range(tile_lo, tile_hi):
        k_idx = t * TILE + tl.arange(0, TILE)  # context positions
        k_ok = k_idx < seq_len
        block = tl.load(table_ptr + k_idx // KV_BLOCK, mask=k_ok, other=0).to(tl.int64)
        within = (k_idx % KV_BLOCK).to(tl.int64)
        k_off = block * stride_kb + within * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + within * stride_vs + kv_head * stride_vh
        kt = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:  # float32 models: no TF32 rounding in the products
            s = tl.dot(q, kt.to(q.dtype), input_precision="ieee") * scale  # [M, TILE]
        else:
            s = tl.dot(q, kt.to(q.dtype)).to(tl.float32) * scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        q_pos = context_len + q_idx  # each row's position in the sequence
        allowed = (k_idx[None, :] <= q_pos[:, None]) & k_ok[None, :] & rows_ok[:, None]
        if WINDOW:
            allowed &= k_idx[None, :] > q_pos[:, None] - window
        if TREE:
            rel = k_idx - context_len  # the key's index among the request's query tokens
            in_span = rel >= 0
            shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)  # a wider shift is undefined
            bit = (tree[:, None] >> shift[None, :]) & 1
            allowed &= ~in_span[None, :] | (bit != 0) | (tree[:, None] == -1)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_ptr, stats_ptr,
    q_ptr, k_ptr, v_ptr,
    tables_ptr, seq_lens_ptr, query_start_ptr, tree_ptr,
    scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table,
    max_q_blocks, num_splits,
    QPK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, TREE: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0) // max_q_blocks
    q_block = tl.program_id(0) % max_q_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // QPK  # the query token of each row, within the request
    head = kv_head * QPK + rows % QPK
    rows_ok = (rows < BLOCK_Q * QPK) & (q_idx < q_len)
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=rows_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    tree = tl.zeros([BLOCK_M], dtype=tl.int64)
    if TREE:
        tree = tl.load(tree_ptr + token, mask=rows_ok, other=0)

    # The context this block of queries reads: up to its last query, from its first one's window.
    last = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    first = 0
    if WINDOW:
        first = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    tile_lo = first // TILE
    tile_hi = last // TILE + 1
    if SPLIT:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], dtype=tl.float32)
    m_i, l_i, acc = _attend_tiles(
        q, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr + seq * stride_table,
        seq_len, context_len, q_idx, rows_ok, tree, tile_lo, tile_hi, kv_head,
        scale, softcap, window,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        KV_BLOCK, TILE, HEAD_P2, HEAD_DIM, SOFTCAP, WINDOW, TREE, IEEE,
    )
    if SPLIT:
        # Partials: [T, H, splits, HEAD_P2] sums, [T, H, splits, 2] (max, normalizer).
        base = (token * (tl.num_programs(1) * QPK) + head) * num_splits + split
        tl.store(part_ptr + base[:, None] * HEAD_P2 + offs_d[None, :], acc, mask=rows_ok[:, None])
        tl.store(stats_ptr + base * 2, m_i, mask=rows_ok)
        tl.store(stats_ptr + base * 2 + 1, l_i, mask=rows_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=rows_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_ptr, stats_ptr, stride_ot, stride_oh, num_heads, num_splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < num_splits
    base = (token * num_heads + head) * num_splits
    m = tl.load(stats_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(stats_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    offs_d = tl.arange(0, HEAD_P2)
    acc = tl.load(part_ptr + (base + s)[:, None] * HEAD_P2 + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        total.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def block_shape(num_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """(QPK, BLOCK_Q, BLOCK_M): query heads per KV head, query tokens and rows a program takes."""
    qpk = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(qpk))
    return qpk, block_m // qpk, block_m


def default_splits(q: torch.Tensor, num_programs: int, max_context: int) -> int:
    """How many ways to split the context: enough programs to fill the GPU's multiprocessors
    (four each), never tiles shorter than two; 1 on CPU (the interpreter runs programs in turn)."""
    if q.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = math.ceil(4 * sms / max(1, num_programs))
    return max(1, min(want, max_context // (2 * TILE_N), 32))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    tree_bits: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] (every request's query tokens, concatenated) over the paged caches
    k_cache, v_cache [num_blocks, block_size, KVH, D] (the step's K/V already written), for
    requests with block_tables [B, max_blocks], seq_lens [B] (context after this step) and
    query_start_loc [B + 1]; tree_bits [T] int64 (optional) as the module says. Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    qpk, block_q, block_m = block_shape(num_heads, num_kv_heads)
    max_q_blocks = triton.cdiv(max_query_len, block_q)
    if num_splits is None:
        longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_splits = default_splits(q, num_seqs * max_q_blocks * num_kv_heads, longest)
    head_p2 = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    part = stats = out  # placeholders the kernel never touches without SPLIT
    if split:
        part = torch.empty(num_tokens, num_heads, num_splits, head_p2, dtype=torch.float32, device=q.device)
        stats = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    grid = (num_seqs * max_q_blocks, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, part, stats,
        q, k_cache, v_cache,
        block_tables, seq_lens, query_start_loc, tree_bits if tree_bits is not None else seq_lens,
        scale, softcap or 0.0, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        max_q_blocks, num_splits,
        QPK=qpk, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=TILE_N, KV_BLOCK=k_cache.shape[1],
        HEAD_DIM=head_dim, HEAD_P2=head_p2,
        SOFTCAP=softcap is not None, WINDOW=window is not None, TREE=tree_bits is not None, SPLIT=split,
        IEEE=q.dtype == torch.float32,
    )
    if split:
        _combine_splits_kernel[(num_tokens, num_heads)](
            out, part, stats, out.stride(0), out.stride(1), num_heads, num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, HEAD_P2=head_p2,
        )
    return out
