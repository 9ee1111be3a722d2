"""KV cache quantization (tandem/model/kv_quant.py): the row layout, the round-trip error of int8 and
fp8 e4m3 against their analytic bounds, and how far a quantized cache moves a model's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.model.forward_batch import ForwardBatch
from tandem.model.kv_quant import KVCacheFormat
from tandem.model.loader import load_model, resolve_dtype


def rows_of_every_size(head_dim: int) -> torch.Tensor:
    """[6, 64, 2, head_dim] rows whose magnitudes span 1e-6 to 1e4, with outlier channels and an
    all-zero row, as K and V rows come (rotary, outlier features, padding)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, 2, head_dim, generator=g)
    x *= torch.logspace(-6, 4, 6)[:, None, None, None]
    x[:, ::7, :, 3] *= 50.0  # a channel far larger than the rest of its row
    x[0, 0, 0] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 6])
def test_int8_round_trip_is_within_half_a_step(dtype, head_dim) -> None:
    fmt = KVCacheFormat("int8", dtype)
    x = rows_of_every_size(head_dim).to(dtype)
    rows = fmt.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == fmt.row_size(head_dim)
    back = fmt.dequantize(rows, head_dim)
    assert back.dtype == dtype and back.shape == x.shape
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    err = _dequant_f32(fmt, rows, head_dim) - xf
    # Rounding to the nearest of 255 levels spread over [-amax, amax]: at most half a step.
    assert (err.abs() <= amax / 254 * (1 + 1e-5)).all()
    # The row's largest element is a level itself: it comes back to float32 rounding.
    top = xf.abs().argmax(-1, keepdim=True)
    assert (err.gather(-1, top).abs() <= amax * 1e-6).all()
    assert torch.equal(back[0, 0, 0], torch.zeros(head_dim, dtype=dtype))  # a zero row stays zero


@pytest.mark.parametrize("alias", ["fp8", "fp8_e4m3"])
def test_fp8_round_trip_is_within_e4m3_precision(alias) -> None:
    fmt = KVCacheFormat(alias, torch.float32)
    assert fmt.kv_cache_dtype == "fp8_e4m3"
    x = rows_of_every_size(64)
    back = fmt.dequantize(fmt.quantize(x), 64)
    scale = x.abs().amax(-1, keepdim=True) / 448
    # Three mantissa bits: half an ulp is at most 1/16 of the value; below e4m3's smallest normal
    # (2^-6 scales) the step is a fixed 2^-9 scales.
    bound = x.abs() / 16 + scale * 2.0**-10
    assert ((back - x).abs() <= bound * (1 + 1e-5)).all()
    # ... and it is not much better than that: the error is e4m3's, not an accidental float32 copy.
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[x.abs() > scale]
    assert 0.01 < rel.mean() < 0.04


def _dequant_f32(fmt: KVCacheFormat, rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The dequantized values before the cast to a 16-bit model dtype (the quantization error alone)."""
    return KVCacheFormat(fmt.kv_cache_dtype, torch.float32).dequantize(rows, head_dim)


def test_layout_and_bytes() -> None:
    f32, bf16 = KVCacheFormat("auto", torch.float32), KVCacheFormat("auto", torch.bfloat16)
    i8 = KVCacheFormat("int8", torch.bfloat16)
    assert (f32.name, bf16.name, i8.name, KVCacheFormat("fp8", torch.float32).name) == (
        "float32",
        "bfloat16",
        "int8",
        "fp8_e4m3",
    )
    assert not f32.quantized and f32.storage_dtype == torch.float32
    assert i8.quantized and i8.storage_dtype == torch.uint8
    # head_dim 64: 64 values + a float32 scale = 68 bytes a row, against 128 (bf16) and 256 (fp32).
    assert (f32.row_bytes(64), bf16.row_bytes(64), i8.row_bytes(64)) == (256, 128, 68)
    # The scale stays 4-byte aligned when head_dim is not a multiple of 4.
    assert i8.row_bytes(6) == 12
    cache = i8.allocate(3, 16, 2, 64, "cpu")
    assert cache.shape == (2, 3, 16, 2, 68) and cache.dtype == torch.uint8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCacheFormat("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="unused", kv_cache_dtype="fp16")


# -- a model's logits with a quantized cache ---------------------------------------------------

PREFILL, DECODE = 64, 32


def teacher_forced_logits(model_dir, dtype: str, kv_cache_dtype: str, ids: list[int]) -> torch.Tensor:
    """Logits of every position: a 64-token prompt in one pass, then one token a step (teacher
    forced, so every variant sees the same context), through a paged cache of `kv_cache_dtype`."""
    cfg = ModelConfig.from_pretrained(model_dir)
    dt = resolve_dtype(dtype, torch.device("cpu"))
    model = load_model(cfg, dt, torch.device("cpu"), "torch", 256, None, kv_cache_dtype)
    fmt = KVCacheFormat(kv_cache_dtype, dt)
    bs = 16
    nb = -(-len(ids) // bs)
    caches = [fmt.allocate(nb, bs, cfg.num_kv_heads, cfg.head_dim, "cpu") for _ in model.layers]
    out = []
    with torch.inference_mode():
        for start, end in [(0, PREFILL)] + [(i, i + 1) for i in range(PREFILL, len(ids))]:
            n = end - start
            batch = ForwardBatch(
                input_ids=torch.tensor(ids[start:end]),
                positions=torch.arange(start, end),
                slot_mapping=torch.arange(start, end),
                logits_indices=torch.arange(n),
                query_start_loc=np.array([0, n]),
                query_lens=np.array([n]),
                seq_lens=np.array([end]),
                block_tables=np.arange(nb)[None],
                block_size=bs,
            )
            model.backend.prepare(batch)
            out.append(model.compute_logits(model(batch, caches)).float())
    return torch.cat(out)


@pytest.mark.slow
def test_quantized_cache_keeps_logits_close(llama_dir) -> None:
    """Against the float32 cache, over 64 prompt positions and 32 decode steps of the tiny random
    Llama (logits' standard deviation about 1.6): int8 stays within 0.35 of every logit (measured
    0.16) and 0.04 on average (measured 0.019, less than computing the whole model in bfloat16
    moves them: 0.024); fp8 e4m3, with 3 mantissa bits, within 2.0 (measured 0.94) and 0.25 on
    average (measured 0.11). The tolerances are about twice what was measured: a change in the
    error's size fails, and the seeded inputs keep it deterministic."""
    ids = torch.randint(3, 512, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = teacher_forced_logits(llama_dir, "float32", "auto", ids)
    err = {kv: (teacher_forced_logits(llama_dir, "float32", kv, ids) - ref).abs() for kv in ("int8", "fp8")}
    assert err["int8"].max() < 0.35 and err["int8"].mean() < 0.04
    assert err["fp8"].max() < 2.0 and err["fp8"].mean() < 0.25
    # Not a no-op: the cache really is quantized, and fp8's coarser mantissa costs more than int8.
    assert err["int8"].mean() > 1e-3 and err["fp8"].mean() > 2 * err["int8"].mean()
