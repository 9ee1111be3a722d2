"""The Triton paged-attention kernel against a torch reference, on small shapes (under the Triton
interpreter on CPU): ragged batches of decodes, verifications and prompt chunks over cached
prefixes, block and tile boundaries, grouped-query heads (a power of two per KV head or not),
head sizes that are not powers of two, sliding windows, soft-capping, tree masks and split-K."""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from tandem.kernels.triton_attention import TILE_N, paged_attention  # noqa: E402


def make_batch(q_lens, ctx_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Random caches and queries for requests with these query lengths and context lengths before
    the query (seq_len = ctx + q); blocks handed out shuffled, so tables are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    blocks_per = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(q_lens), max(blocks_per), dtype=torch.int32)
    i = 0
    for r, n in enumerate(blocks_per):
        tables[r, :n] = torch.tensor(order[i : i + n])
        i += n
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def reference(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window=None, softcap=None, tree=None):
    out = torch.empty_like(q)
    num_heads, kvh = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    for r in range(len(seq_lens)):
        s, a, b = int(seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        ql = b - a
        ctx = s - ql
        pos = torch.arange(s)
        slots = tables[r, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, kvh, k_cache.shape[-1])[slots].double().repeat_interleave(num_heads // kvh, 1)
        v = v_cache.reshape(-1, kvh, v_cache.shape[-1])[slots].double().repeat_interleave(num_heads // kvh, 1)
        qq = q[a:b].double()
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = ctx + torch.arange(ql)
        allowed = pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > q_pos[:, None] - window
        if tree is not None:
            rel = pos - ctx
            bits = (tree[a:b, None] >> rel.clamp(min=0)[None, :]) & 1
            allowed &= (rel[None, :] < 0) | (bits != 0)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).to(q.dtype)
    return out


def run(q_lens, ctx_lens, block_size=16, heads=(4, 2), head_dim=16, dtype=torch.float32, **kw):
    q, kc, vc, tables, seq_lens, qsl = make_batch(q_lens, ctx_lens, block_size, *heads, head_dim, dtype)
    scale = head_dim**-0.5
    tree = kw.pop("tree", None)
    splits = kw.pop("num_splits", 1)
    got = paged_attention(
        q, kc, vc, tables, seq_lens, qsl, max(q_lens), scale, tree_bits=tree, num_splits=splits, **kw
    )
    want = reference(q, kc, vc, tables, seq_lens, qsl, scale, tree=tree, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_ragged_batch_of_decodes_verifications_and_chunks():
    # A decode, a 4-token verification, a prompt chunk over a cached prefix, a fresh prompt.
    run([1, 4, 20, 9], [37, 12, 40, 0])


@pytest.mark.parametrize("block_size", [4, 16, 64])
def test_block_and_tile_boundaries(block_size):
    # Context lengths on and either side of block and tile edges.
    run([1, 1, 1, 3], [TILE_N - 1, TILE_N, 2 * TILE_N + 1, block_size * 3 - 1], block_size=block_size)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa-3", "mqa"])
def test_head_layouts(heads):
    run([1, 5], [30, 17], heads=heads)


def test_a_head_size_not_a_power_of_two():
    run([2, 1], [21, 50], head_dim=24)


def test_a_sliding_window():
    run([1, 6, 12], [70, 40, 3], window=16)


def test_soft_capping():
    run([1, 7], [33, 20], softcap=5.0)


def test_a_tree_verification_mask():
    """Query tokens 0..4 of a request as a tree: 0 the root, 1 and 2 its children, 3 under 1, 4
    under 2; each sees its ancestors and itself (bit i = query token i)."""
    ancestors = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]
    bits = [sum(1 << i for i in a) for a in ancestors]
    tree = torch.tensor([1, *bits, *bits], dtype=torch.int64)  # a decode first (bit 0: itself)
    run([1, 5, 5], [20, 31, 2], tree=tree)


def test_a_tree_beside_a_long_chunk():
    """Tokens outside every tree carry all bits (-1), whatever their query's length."""
    ancestors = [[0], [0, 1], [0, 1, 2], [0, 3]]
    bits = [sum(1 << i for i in a) for a in ancestors]
    tree = torch.tensor([*bits, *([-1] * 90)], dtype=torch.int64)
    run([4, 90], [10, 5], tree=tree)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_matches_one_pass(num_splits):
    # Long contexts, short queries: with more splits than a request has tiles, some are empty.
    run([1, 1, 2], [200, 9, 150], num_splits=num_splits)


def test_half_precision():
    run([1, 4, 16], [40, 8, 17], dtype=torch.float16)
