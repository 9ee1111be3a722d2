"""The torch attention backend on a mixed ragged batch, against per-request reference attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem import kernels
from tandem.model.attention import (
    FUSED_MAX_QUERY,
    LayerAttention,
    TorchAttentionBackend,
    _Paged,
    kernel_takes_long_queries,
)
from tandem.model.forward_batch import ForwardBatch
from tandem.model.kv_quant import KVCacheFormat

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4


def make_batch(
    q_lens: list[int], seq_lens: list[int], num_blocks: int, rng: np.random.Generator, block: int = BLOCK
):
    """A flat batch whose requests own shuffled, disjoint blocks of the cache."""
    free = list(rng.permutation(num_blocks))
    tables = []
    for s in seq_lens:
        tables.append([int(free.pop()) for _ in range(-(-s // block))])
    width = max(len(t) for t in tables)
    block_tables = np.zeros((len(q_lens), width), dtype=np.int64)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    q = np.asarray(q_lens, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    qsl = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    positions = np.concatenate([np.arange(s - n, s) for n, s in zip(q, seq)])
    req = np.repeat(np.arange(len(q)), q)
    slots = block_tables[req, positions // block] * block + positions % block
    return ForwardBatch(
        input_ids=torch.zeros(int(qsl[-1]), dtype=torch.long),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        logits_indices=torch.empty(0, dtype=torch.long),
        query_start_loc=qsl,
        query_lens=q,
        seq_lens=seq,
        block_tables=block_tables,
        block_size=block,
    )


def reference(q, k_cache, v_cache, batch: ForwardBatch, scale: float, window: int | None) -> torch.Tensor:
    block = batch.block_size
    out = torch.empty_like(q, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for i in range(batch.num_requests):
        start, n, s = int(batch.query_start_loc[i]), int(batch.query_lens[i]), int(batch.seq_lens[i])
        pos = np.arange(s)
        slots = batch.block_tables[i, pos // block] * block + pos % block
        k = k_cache[torch.from_numpy(slots)].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_cache[torch.from_numpy(slots)].double().repeat_interleave(group, dim=1)
        for j in range(n):
            qpos = s - n + j
            allowed = pos <= qpos
            if window is not None:
                allowed &= pos > qpos - window
            scores = torch.einsum("hd,shd->hs", q[start + j].double(), k) * scale
            scores[:, torch.from_numpy(~allowed)] = float("-inf")
            out[start + j] = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_reference_and_groups_by_query_length(window) -> None:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    # Decodes, speculative verifications (3 and 5 tokens), a fresh prompt and a prompt chunk with context.
    q_lens = [1, 5, 1, 3, 40, 17, 5]
    seq_lens = [9, 30, 22, 7, 40, 50, 5]
    num_blocks = 64
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, sliding_window=window, use_kernel=False)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    t = batch.num_tokens
    q = torch.randn(t, HEADS, HEAD_DIM)
    k = torch.randn(t, KV_HEADS, HEAD_DIM)
    v = torch.randn(t, KV_HEADS, HEAD_DIM)
    backend.prepare(batch)
    # Query-length buckets 1 | 3 | 5, 5 | 17 | 40: no request is padded to a longer bucket's length.
    sizes = sorted(int(g.q_index.shape[0]) * int(g.q_index.shape[1]) for g in batch.attn_metadata)
    assert sizes == [2, 3, 10, 17, 40]
    out = backend.forward(q, k, v, cache, batch)
    k_cache, v_cache = cache[0].view(-1, KV_HEADS, HEAD_DIM), cache[1].view(-1, KV_HEADS, HEAD_DIM)
    assert torch.equal(k_cache[batch.slot_mapping], k)  # the new K/V went to their slots
    expected = reference(q, k_cache, v_cache, batch, HEAD_DIM**-0.5, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_pure_decode_batch_skips_the_gathers() -> None:
    rng = np.random.default_rng(1)
    batch = make_batch([1, 1, 1], [5, 12, 3], 16, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, use_kernel=False)
    backend.prepare(batch)
    assert len(batch.attn_metadata) == 1 and batch.attn_metadata[0].whole_batch
    cache = torch.randn(2, 16, BLOCK, KV_HEADS, HEAD_DIM)
    q = torch.randn(3, HEADS, HEAD_DIM)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    out = backend.forward(q, k, v, cache, batch)
    k_cache, v_cache = cache[0].view(-1, KV_HEADS, HEAD_DIM), cache[1].view(-1, KV_HEADS, HEAD_DIM)
    expected = reference(q, k_cache, v_cache, batch, HEAD_DIM**-0.5, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def needs_kernel(test):
    """A test of the fused paged-attention kernel: marked `kernels`, skipped where it did not build."""
    skip = pytest.mark.skipif(not kernels.has("paged_attention"), reason="Tandem's kernels did not build")
    return pytest.mark.kernels(skip(test))


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_matches_reference_on_short_queries(window, dtype) -> None:
    rng = np.random.default_rng(2)
    torch.manual_seed(2)
    # Decodes and verifications, one of them covering a whole (short) prompt.
    q_lens = [1, 5, 1, 3, 16, 2]
    seq_lens = [9, 30, 22, 3, 40, 2]
    num_blocks = 64
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, sliding_window=window)
    backend.prepare(batch)
    assert not isinstance(batch.attn_metadata, list)  # took the kernel
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    t = batch.num_tokens
    # q and k as strided views of one projection, as the model passes them.
    qkv = torch.randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    out = backend.forward(q, k, v, cache, batch)
    assert out.dtype == dtype and out.shape == q.shape
    k_cache, v_cache = cache[0].view(-1, KV_HEADS, HEAD_DIM), cache[1].view(-1, KV_HEADS, HEAD_DIM)
    assert torch.equal(k_cache[batch.slot_mapping], k) and torch.equal(v_cache[batch.slot_mapping], v)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), batch, HEAD_DIM**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 1, 40), (5, 1, 80), (6, 3, 64)])
def test_fused_kernel_head_layouts(heads, kv_heads, head_dim) -> None:
    """The kernel tiles a KV group's query vectors (query tokens x the group's heads) 8 or 16 at a
    time and head_dim 32 or 64 elements at a time (AVX2 / AVX-512): groups of 1 to 8 heads, tiles that split a request's
    queries, and head sizes that are not a multiple of the tiles all match the reference."""
    rng = np.random.default_rng(6)
    torch.manual_seed(6)
    q_lens = [1, 5, 16, 3, 9]
    seq_lens = [37, 12, 16, 70, 9]
    num_blocks = 64
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim)
    backend.prepare(batch)
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim)
    t = batch.num_tokens
    q, k, v = (
        torch.randn(t, heads, head_dim),
        torch.randn(t, kv_heads, head_dim),
        torch.randn(t, kv_heads, head_dim),
    )
    out = backend.forward(q, k, v, cache, batch)
    k_cache, v_cache = cache[0].view(-1, kv_heads, head_dim), cache[1].view(-1, kv_heads, head_dim)
    expected = reference(q, k_cache, v_cache, batch, head_dim**-0.5, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "q_lens"), [
    (7, 1, [1, 1, 1]),  # decodes, group of 7: the 8-wide tile
    (14, 2, [1, 1, 1, 1]),
    (8, 1, [1, 1]),  # exactly 8
    (6, 6, [1, 1, 1]),  # group of 1
    (4, 1, [1, 2, 1]),  # a 2-token verification of a group of 4: 8 vectors, still narrow
    (9, 1, [1, 1]),  # group of 9: the 16-wide tile
    (5, 1, [1, 2]),  # 10 vectors: 16-wide
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_query_tiles(heads, kv_heads, q_lens, dtype) -> None:
    """Batches whose every request has at most 8 query vectors (query tokens x GQA group) take an
    8-wide tile, others the 16-wide one: both match the reference."""
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    seq_lens = [40, 3, 100, 17][: len(q_lens)]
    num_blocks = 64
    head_dim = 64
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim)
    backend.prepare(batch)
    assert not isinstance(batch.attn_metadata, list)  # took the kernel
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim).to(dtype)
    t = batch.num_tokens
    q = torch.randn(t, heads, head_dim).to(dtype)
    k, v = torch.randn(t, kv_heads, head_dim).to(dtype), torch.randn(t, kv_heads, head_dim).to(dtype)
    out = backend.forward(q, k, v, cache, batch)
    k_cache, v_cache = cache[0].view(-1, kv_heads, head_dim), cache[1].view(-1, kv_heads, head_dim)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), batch, head_dim**-0.5, None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(14, 2, 64), (9, 3, 64), (16, 1, 64), (4, 4, 128), (16, 4, 128)]
)
@pytest.mark.parametrize("window", [None, 7])
def test_bfloat16_decodes_match_reference(heads, kv_heads, head_dim, window) -> None:
    """Decodes over a bfloat16 cache, which have a path of their own with AVX512-BF16 (the GQA
    group's queries against each key row as bfloat16 pairs, four positions at a time): groups of 1
    to 16 heads, head_dim 64 and 128, contexts of 1 to 130 positions (not multiples of four, longer
    than the rows fetched ahead), beside a verification that keeps the general loop."""
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    q_lens = [1, 1, 1, 1, 3]
    seq_lens = [1, 5, 37, 130, 20]
    num_blocks = 128
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, sliding_window=window)
    backend.prepare(batch)
    assert not isinstance(batch.attn_metadata, list)  # took the kernel
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim).to(torch.bfloat16)
    t = batch.num_tokens
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim).to(torch.bfloat16)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    out = backend.forward(q, k, v, cache, batch)
    k_cache, v_cache = cache[0].view(-1, kv_heads, head_dim), cache[1].view(-1, kv_heads, head_dim)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), batch, head_dim**-0.5, window)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not kernels.has("paged_attention_amx"), reason="needs AMX")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block"), [
    (14, 2, 64, 16),  # the 415M peer checkpoint's layout
    (7, 1, 128, 16),
    (4, 2, 64, 4),  # blocks smaller than a 16-position tile
])
def test_amx_kernel_takes_every_query_length(heads, kv_heads, head_dim, block) -> None:
    """A bfloat16 cache on AMX: decodes, verifications, a prompt chunk over cached context and a
    fresh prompt all go to the tile kernel in one call and match the reference. Cache rows outside
    every context hold NaN, which must not reach the output."""
    rng = np.random.default_rng(8)
    torch.manual_seed(8)
    num_blocks = 4 * 130 // block + 8
    q_lens = [1, 5, 70, 40, 1]
    seq_lens = [40, 16, 100, 40, 130]  # request 3 is a fresh prompt (query = whole context)
    batch = make_batch(q_lens, seq_lens, num_blocks, rng, block=block)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, kv_format=KVCacheFormat("auto", torch.bfloat16))
    backend.prepare(batch)
    assert isinstance(batch.attn_metadata, _Paged) and batch.attn_metadata.tiles
    cache = torch.full((2, num_blocks, block, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    flat = cache.view(2, -1, kv_heads, head_dim)
    for i, s in enumerate(seq_lens):
        pos = np.arange(s)
        slots = torch.from_numpy(batch.block_tables[i, pos // block] * block + pos % block)
        flat[:, slots] = torch.randn(2, s, kv_heads, head_dim).to(torch.bfloat16)
    t = batch.num_tokens
    q = torch.randn(t, heads, head_dim).to(torch.bfloat16)
    k, v = (torch.randn(t, kv_heads, head_dim).to(torch.bfloat16) for _ in range(2))
    out = backend.forward(q, k, v, cache, batch)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    expected = reference(q.float(), flat[0].float(), flat[1].float(), batch, head_dim**-0.5, None)
    # bfloat16 probabilities in the value product: within a few bfloat16 steps of the output
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_amx_kernel_is_not_taken_where_it_does_not_apply() -> None:
    bf16 = KVCacheFormat("auto", torch.bfloat16)
    assert not TorchAttentionBackend(4, 2, 64, kv_format=KVCacheFormat("auto", torch.float32)).tiles
    assert not TorchAttentionBackend(4, 2, 80, kv_format=bf16).tiles  # head_dim
    assert not TorchAttentionBackend(4, 2, 64, sliding_window=8, kv_format=bf16).tiles
    assert not TorchAttentionBackend(4, 2, 64, kv_format=KVCacheFormat("int8", torch.bfloat16)).tiles
    assert not TorchAttentionBackend(4, 2, 64, use_kernel=False, kv_format=bf16).tiles
    backend = TorchAttentionBackend(4, 2, 64, kv_format=bf16)
    backend.layer(LayerAttention(softcap=30.0))
    assert not backend.tiles


@needs_kernel
def test_long_queries_keep_the_sdpa_path() -> None:
    rng = np.random.default_rng(3)
    batch = make_batch([FUSED_MAX_QUERY + 1, 40], [30, 40], 32, rng)
    TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, long_queries=False).prepare(batch)
    assert isinstance(batch.attn_metadata, list)
    assert not any(isinstance(g, _Paged) for g in batch.attn_metadata)


def assert_writes_and_matches_reference(backend, batch, num_blocks: int, dtype: torch.dtype, window) -> None:
    """The backend (prepared for `batch`) writes every new K/V to its slot and matches the
    per-request reference over what the cache then holds."""
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    qkv = torch.randn(batch.num_tokens, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    out = backend.forward(q, k, v, cache, batch)
    k_cache, v_cache = cache[0].view(-1, KV_HEADS, HEAD_DIM), cache[1].view(-1, KV_HEADS, HEAD_DIM)
    assert torch.equal(k_cache[batch.slot_mapping], k) and torch.equal(v_cache[batch.slot_mapping], v)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), batch, HEAD_DIM**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("long_queries", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_sends_short_queries_to_the_kernel(window, dtype, long_queries) -> None:
    """Decodes and verifications sharing a step with prompt chunks take the kernel, the chunks SDPA
    (with long queries on, the kernel too: one call per layer); together they match the per-request
    reference, and every new K/V is in its slot."""
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    # Decodes, verifications, a fresh 40-token prompt, chunks over cached context.
    q_lens = [1, 40, 5, 1, FUSED_MAX_QUERY + 1, 3, 24]
    seq_lens = [9, 40, 30, 22, 50, 7, 60]
    num_blocks = 96
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, sliding_window=window, long_queries=long_queries)
    backend.prepare(batch)
    if long_queries:
        assert isinstance(batch.attn_metadata, _Paged) and batch.attn_metadata.rows is None
    else:
        paged = [g for g in batch.attn_metadata if isinstance(g, _Paged)]
        assert len(paged) == 1 and paged[0].rows.tolist() == [0, 41, 42, 43, 44, 45, 46, 64, 65, 66]
    assert_writes_and_matches_reference(backend, batch, num_blocks, dtype, window)


@needs_kernel
def test_quantized_cache_keeps_prompt_chunks_on_sdpa() -> None:
    """long_queries applies to an unquantized cache only: with int8 rows a chunk stays on the grouped path."""
    batch = make_batch([1, FUSED_MAX_QUERY + 1], [9, 30], 32, np.random.default_rng(7))
    fmt = KVCacheFormat("int8", torch.float32)
    TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, kv_format=fmt, long_queries=True).prepare(batch)
    assert isinstance(batch.attn_metadata, list) and len(batch.attn_metadata) == 2


def test_long_query_rule_follows_cpu_features() -> None:
    assert kernel_takes_long_queries({"avx512f", "avx512_bf16", "avx512_vnni"})  # AMD EPYC kind
    assert not kernel_takes_long_queries({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert not kernel_takes_long_queries({"avx2", "fma"})


@needs_kernel
def test_start_up_log_names_each_querys_path() -> None:
    describe = [
        TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, long_queries=True).describe(),
        TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, long_queries=False).describe(),
        TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, use_kernel=False).describe(),
    ]
    assert describe == [
        "paged_attention kernel, every query (AVX-512 without AMX: prompt chunks too)",
        f"paged_attention kernel for queries up to {FUSED_MAX_QUERY} tokens, SDPA for prompt chunks",
        "PyTorch SDPA over the gathered context",
    ]


@needs_kernel
def test_fused_kernel_rejects_inconsistent_layout() -> None:
    rng = np.random.default_rng(4)
    batch = make_batch([2], [6], 8, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    backend.prepare(batch)
    batch.attn_metadata.seq_lens[0] = 1  # fewer context tokens than queries
    cache = torch.zeros(2, 8, BLOCK, KV_HEADS, HEAD_DIM)
    q, k = torch.randn(2, HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="does not fit"):
        backend.forward(q, k, k, cache, batch)


def quantized_kernel(test):
    """A test that runs the quantized cache's kernel where it built, and the torch path always."""
    built = kernels.has("paged_attention_quantized")
    kernel = pytest.param(True, marks=[pytest.mark.kernels, pytest.mark.skipif(not built, reason="no kernels")])
    return pytest.mark.parametrize("use_kernel", [False, kernel], ids=["torch", "kernel"])(test)


@quantized_kernel
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("dtype", "window"), [(torch.float32, None), (torch.float32, 5), (torch.bfloat16, None)])
def test_quantized_cache_matches_reference_on_what_it_holds(kv_cache_dtype, dtype, window, use_kernel) -> None:
    """A quantized cache: the new K/V land in their slots as quantized rows (scales included), and
    every request, the fresh prompt too, attends to exactly the dequantized values the cache holds,
    on the torch path and, for the short queries, in the kernel."""
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    q_lens = [1, 5, 1, 3, 40, 17, 5]  # decodes, verifications, a fresh prompt, a chunk with context
    seq_lens = [9, 30, 22, 7, 40, 50, 5]
    num_blocks = 64
    fmt = KVCacheFormat(kv_cache_dtype, dtype)
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, window, use_kernel=use_kernel, kv_format=fmt)
    backend.prepare(batch)
    paged = [g for g in batch.attn_metadata if isinstance(g, _Paged)]
    assert len(paged) == (1 if use_kernel else 0)
    cache = fmt.quantize(torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    assert cache.dtype == torch.uint8 and cache.shape[-1] == HEAD_DIM + 4
    t = batch.num_tokens
    qkv = torch.randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    out = backend.forward(q, k, v, cache, batch)
    assert out.dtype == dtype and out.shape == q.shape
    rows = cache.view(2, -1, KV_HEADS, HEAD_DIM + 4)
    assert torch.equal(rows[0][batch.slot_mapping], fmt.quantize(k))
    assert torch.equal(rows[1][batch.slot_mapping], fmt.quantize(v))
    k_cache, v_cache = fmt.dequantize(rows[0], HEAD_DIM), fmt.dequantize(rows[1], HEAD_DIM)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), batch, HEAD_DIM**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 1, 40), (5, 1, 80), (6, 3, 64), (4, 2, 6)])
def test_quantized_kernel_on_short_queries(kv_cache_dtype, heads, kv_heads, head_dim) -> None:
    """Decodes and verifications only (the whole batch in one kernel call), over head sizes whose
    rows pad to 4 bytes before the scale or span several 64-element output tiles."""
    rng = np.random.default_rng(8)
    torch.manual_seed(8)
    q_lens, seq_lens = [1, 5, 16, 3, 9], [37, 12, 16, 70, 9]
    num_blocks = 64
    fmt = KVCacheFormat(kv_cache_dtype, torch.float32)
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, kv_format=fmt)
    backend.prepare(batch)
    assert isinstance(batch.attn_metadata, _Paged)
    # Blocks of rows from 0.1 to 10 times the others' size: each scale must be applied to its own row
    # (the tolerance is relative to those sizes).
    sizes = torch.logspace(-1, 1, num_blocks)[:, None, None, None]
    values = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim) * sizes
    cache = fmt.quantize(values)
    t = batch.num_tokens
    q, k, v = (torch.randn(t, heads, head_dim), torch.randn(t, kv_heads, head_dim), torch.randn(t, kv_heads, head_dim))
    out = backend.forward(q, k, v, cache, batch)
    row = fmt.row_size(head_dim)
    rows = cache.view(2, -1, kv_heads, row)
    assert torch.equal(rows[0][batch.slot_mapping], fmt.quantize(k))
    k_cache, v_cache = fmt.dequantize(rows[0], head_dim), fmt.dequantize(rows[1], head_dim)
    expected = reference(q, k_cache, v_cache, batch, head_dim**-0.5, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
