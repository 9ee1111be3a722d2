"""Per-layer attention variations (LayerAttention: a layer's own sliding window, scale and logit
soft-cap) in the torch backend, on mixed ragged batches, against per-request reference attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attention import BLOCK, HEAD_DIM, HEADS, KV_HEADS, make_batch, needs_kernel

from tandem.model.attention import LayerAttention, TorchAttentionBackend, _Paged
from tandem.model.forward_batch import ForwardBatch

# Decodes, speculative verifications, a fresh prompt and prompt chunks with context.
MIXED = ([1, 5, 1, 3, 40, 17, 5], [9, 30, 22, 7, 40, 50, 5])


def reference(q, kv_cache, batch: ForwardBatch, layer: LayerAttention) -> torch.Tensor:
    k_cache = kv_cache[0].view(-1, KV_HEADS, HEAD_DIM).double()
    v_cache = kv_cache[1].view(-1, KV_HEADS, HEAD_DIM).double()
    scale = HEAD_DIM**-0.5 if layer.scale is None else layer.scale
    out = torch.empty_like(q, dtype=torch.float64)
    for i in range(batch.num_requests):
        start, n, s = int(batch.query_start_loc[i]), int(batch.query_lens[i]), int(batch.seq_lens[i])
        pos = np.arange(s)
        slots = torch.from_numpy(batch.block_tables[i, pos // BLOCK] * BLOCK + pos % BLOCK)
        k = k_cache[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [S, H, D]
        v = v_cache[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
        qpos = np.arange(s - n, s)[:, None]
        allowed = pos[None, :] <= qpos  # [n, S]
        if layer.sliding_window is not None:
            allowed &= pos[None, :] > qpos - layer.sliding_window
        scores = torch.einsum("nhd,shd->nhs", q[start : start + n].double(), k) * scale
        if layer.softcap is not None:
            scores = layer.softcap * torch.tanh(scores / layer.softcap)
        scores = scores.masked_fill(~torch.from_numpy(allowed)[:, None, :], float("-inf"))
        out[start : start + n] = torch.einsum("nhs,shd->nhd", scores.softmax(-1), v)
    return out


LAYERS = {
    "window-softcap-scale": LayerAttention(sliding_window=5, softcap=2.0, scale=0.3),
    "full-softcap-scale": LayerAttention(softcap=2.0, scale=0.3),
    "window-scale": LayerAttention(sliding_window=7, scale=0.4),
    "full-scale": LayerAttention(scale=0.4),
}


def _run(q_lens, seq_lens, default_window, layers, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    num_blocks = 96
    batch = make_batch(q_lens, seq_lens, num_blocks, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, sliding_window=default_window, use_kernel=False)
    declared = [backend.layer(spec) for spec in layers]
    backend.prepare(batch)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    t = batch.num_tokens
    q, k, v = torch.randn(t, HEADS, HEAD_DIM), torch.randn(t, KV_HEADS, HEAD_DIM), torch.randn(t, KV_HEADS, HEAD_DIM)
    for spec in declared:
        out = backend.forward(q, k, v, cache, batch, spec)
        assert torch.equal(cache[0].view(-1, KV_HEADS, HEAD_DIM)[batch.slot_mapping], k)
        torch.testing.assert_close(out.double(), reference(q, cache, batch, spec), rtol=1e-4, atol=1e-5)
    # A layer with no variation still gets the backend's defaults.
    out = backend.forward(q, k, v, cache, batch)
    torch.testing.assert_close(out.double(), reference(q, cache, batch, LayerAttention(default_window)), rtol=1e-4, atol=1e-5)
    return batch


@pytest.mark.parametrize("default_window", [None, 6])
def test_each_layer_gets_its_window_scale_and_softcap_on_a_mixed_batch(default_window) -> None:
    batch = _run(*MIXED, default_window, list(LAYERS.values()), seed=0)
    # One mask per window that differs from the default, in every group.
    windows = {spec.sliding_window for spec in LAYERS.values()} - {default_window}
    for g in batch.attn_metadata:
        assert set(g.window_masks) == windows


def test_pure_decode_batch_with_layer_variations() -> None:
    batch = _run([1, 1, 1, 1], [5, 12, 3, 30], None, list(LAYERS.values()), seed=1)
    assert len(batch.attn_metadata) == 1 and batch.attn_metadata[0].whole_batch


def test_one_fresh_prompt_with_layer_variations() -> None:
    """A lone prompt with no context takes plain causal attention over its own K/V; a windowed
    layer masks it, a soft-capped one computes the scores itself."""
    batch = _run([23], [23], None, list(LAYERS.values()), seed=2)
    (g,) = batch.attn_metadata
    assert g.mask is None and g.kv_slots.numel() == 0


def test_a_softcap_turns_the_kernel_off() -> None:
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    backend.layer(LayerAttention(sliding_window=4, scale=0.2))
    backend.layer(LayerAttention(softcap=30.0))
    assert backend.fused is False
    batch = make_batch([1, 1], [5, 9], 8, np.random.default_rng(3))
    backend.prepare(batch)
    assert not isinstance(batch.attn_metadata, _Paged)
    assert not any(isinstance(g, _Paged) for g in batch.attn_metadata)


@needs_kernel
@pytest.mark.parametrize("long_queries", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_kernel_takes_layer_windows_and_scales(mixed, long_queries) -> None:
    """Layers without a soft-cap keep the kernel, which takes each layer's window and scale (with
    long queries on, a prompt's too)."""
    rng = np.random.default_rng(4)
    torch.manual_seed(4)
    q_lens, seq_lens = ([1, 40, 5, 1, 3], [9, 40, 30, 22, 7]) if mixed else ([1, 5, 1, 3], [9, 30, 22, 7])
    batch = make_batch(q_lens, seq_lens, 64, rng)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, long_queries=long_queries)
    specs = [backend.layer(LAYERS["window-scale"]), backend.layer(LAYERS["full-scale"])]
    backend.prepare(batch)
    meta = batch.attn_metadata
    if mixed and not long_queries:
        assert any(isinstance(g, _Paged) for g in meta)
    else:
        assert isinstance(meta, _Paged)
    cache = torch.randn(2, 64, BLOCK, KV_HEADS, HEAD_DIM)
    t = batch.num_tokens
    q, k, v = torch.randn(t, HEADS, HEAD_DIM), torch.randn(t, KV_HEADS, HEAD_DIM), torch.randn(t, KV_HEADS, HEAD_DIM)
    for spec in specs:
        out = backend.forward(q, k, v, cache, batch, spec)
        torch.testing.assert_close(out.double(), reference(q, cache, batch, spec), rtol=1e-5, atol=1e-5)
