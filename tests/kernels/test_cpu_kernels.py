"""Tandem's compiled CPU kernels (tandem/kernels) against exact references, and their fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.cpu import cpu_flags
from tandem.model import linear
from tandem.model.linear import PackedLinear, onednn_available
from tandem.model.quant import Int8Linear

SHAPES = [(37, 40), (130, 96), (64, 100), (8, 64), (3, 32)]  # (out, in): ragged tails in both dimensions


def _bf16_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


@pytest.mark.skipif(not kernels.has("gemv_bf16"), reason="host CPU has no AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_bf16_matches_float_reference(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 100 + shape[0])
    n, k = shape
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    # Products of bfloat16 values are exact in float32; only the summation order differs.
    ref = F.linear(_bf16_round(x), w.float(), b)
    y32 = torch.ops.tandem.gemv_bf16(x, w, b)
    assert y32.dtype == torch.float32 and y32.shape == (rows, n)
    torch.testing.assert_close(y32, ref, rtol=1e-5, atol=1e-4)
    y16 = torch.ops.tandem.gemv_bf16(x.to(torch.bfloat16), w, None if b is None else b.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    ref16 = F.linear(_bf16_round(x), w.float(), None if b is None else _bf16_round(b))
    torch.testing.assert_close(y16.float(), ref16, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not kernels.has("gemv_f32"), reason="host CPU has neither AVX-512 nor AVX2 + FMA")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_f32_matches_f_linear(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 100 + shape[0])
    n, k = shape
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    y = torch.ops.tandem.gemv_f32(x, w, b)
    torch.testing.assert_close(y, F.linear(x.double(), w.double(), None if b is None else b.double()).float())
    # A strided (non-contiguous) activation is read correctly too.
    xs = torch.randn(k, rows, generator=g).T
    torch.testing.assert_close(torch.ops.tandem.gemv_f32(xs, w, None), F.linear(xs, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernels.has("gemm_w8a8"), reason="host CPU has neither AVX512-VNNI nor AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_w8a8_takes_zero_rows(dtype):
    w = torch.zeros(8, 64, dtype=torch.int8)
    y = torch.ops.tandem.gemm_w8a8(torch.zeros(0, 64, dtype=dtype), w, torch.ones(8), torch.zeros(8, dtype=torch.int32), None)
    assert y.shape == (0, 8) and y.dtype == dtype


@pytest.mark.skipif(not kernels.has("gemm_w8a8"), reason="host CPU has neither AVX512-VNNI nor AVX2")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_w8a8_matches_integer_reference(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 100 + shape[0])
    n, k = shape
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, generator=g) / 100 + 1e-3
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g) * 3
    x[0, 0] = 0.0
    # The kernel's scheme, computed exactly: one symmetric scale per activation row.
    x_scale = x.abs().amax(1).clamp(min=1e-12) / 127
    xq = torch.round(x / x_scale[:, None]).clamp(-127, 127).to(torch.int64)
    dot = xq @ w.to(torch.int64).T
    ref = dot.double() * x_scale.double()[:, None] * w_scale.double()
    if b is not None:
        ref = ref + b.double()
    y = torch.ops.tandem.gemm_w8a8(x, w, w_scale, w.sum(1, dtype=torch.int32), b)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # bfloat16 activations: read as they are, the result rounded to bfloat16 (PyTorch's rounding
    # of the float32 result the same activations give).
    xb = x.to(torch.bfloat16)
    yb = torch.ops.tandem.gemm_w8a8(xb, w, w_scale, w.sum(1, dtype=torch.int32), b)
    assert yb.dtype == torch.bfloat16
    expect = torch.ops.tandem.gemm_w8a8(xb.float(), w, w_scale, w.sum(1, dtype=torch.int32), b).to(torch.bfloat16)
    assert torch.equal(yb, expect)


@pytest.mark.skipif(not onednn_available(torch.bfloat16), reason="oneDNN packs no bfloat16 here")
def test_bf16_layer_runs_its_few_row_path_to_the_limit_and_onednn_above():
    """A bfloat16 layer without AMX tiles keeps its plain weight for the kernel's rows (its panels
    for every row count on a CPU with AVX512-BF16 and no AMX) and agrees with the float reference
    on each side of the limit."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 48, generator=g).to(torch.bfloat16)
    layer = PackedLinear(w, None)
    if layer.tiles is not None:
        pytest.skip("AMX tiles take every few-row product here")
    if layer.panels is not None and linear.bf16_panels_every_row_count():
        assert layer.packed is None and layer.plain is None
    elif kernels.has("gemv_bf16"):
        assert layer.plain_max_rows == linear.kernel_max_rows(torch.bfloat16)
        if "amx_bf16" not in cpu_flags():
            assert layer.plain_max_rows == 16
    for rows in (1, 4, 5, 16, 17, 24):
        x = torch.randn(rows, 48, generator=g).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        torch.testing.assert_close(layer(x).float(), ref, rtol=1e-2, atol=2e-2)


@pytest.mark.skipif(not kernels.load(), reason="kernels did not build here")
def test_kernels_reject_bad_input():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    if kernels.has("gemv_bf16"):
        with pytest.raises(RuntimeError, match="at most 16 rows"):
            torch.ops.tandem.gemv_bf16(torch.zeros(17, 16), w, None)
        with pytest.raises(RuntimeError, match="columns"):
            torch.ops.tandem.gemv_bf16(torch.zeros(1, 15), w, None)
        with pytest.raises(RuntimeError, match="bfloat16"):
            torch.ops.tandem.gemv_bf16(torch.zeros(1, 16), w.float(), None)
    if kernels.has("gemm_w8a8"):
        wq = torch.zeros(8, 16, dtype=torch.int8)
        with pytest.raises(RuntimeError, match="one per output row"):
            torch.ops.tandem.gemm_w8a8(
                torch.zeros(1, 16), wq, torch.ones(7), torch.zeros(8, dtype=torch.int32), None
            )


def test_second_copy_only_while_it_fits_in_memory():
    """Layers hold a second form of their weights only while all linear weights take at most
    SECOND_COPY_MAX_MEMORY_FRACTION of the available memory (always when that is unknown); held
    once, a float32 layer keeps oneDNN's layout alone and gives its products."""
    from tandem.config import SECOND_COPY_MAX_MEMORY_FRACTION

    avail = 24 << 30
    assert linear.keeps_second_copy(int(SECOND_COPY_MAX_MEMORY_FRACTION * avail), avail)
    assert not linear.keeps_second_copy(int(SECOND_COPY_MAX_MEMORY_FRACTION * avail) + 1, avail)
    assert linear.keeps_second_copy(1 << 40, None)
    assert (linear.available_memory() or 1) > 0
    if onednn_available():
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g)
        once = PackedLinear(w, None, second_copy=False)
        assert once.plain is None and once.plain_max_rows == 0 and once.packed is not None
        for rows in (1, 3, 40):
            x = torch.randn(rows, 16, generator=g)
            torch.testing.assert_close(once(x), x @ w.T, rtol=1e-5, atol=1e-5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8))
        linear.pack_linears(model, second_copy=False)
        assert all(isinstance(m, PackedLinear) and m.plain is None and m.tiles is None for m in model)


def test_env_switch_disables_kernels(monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert not kernels.load() and not kernels.has("gemv_bf16")
    if onednn_available(torch.bfloat16):
        assert PackedLinear(torch.randn(8, 16).to(torch.bfloat16), None).plain is None
    if onednn_available():
        few = PackedLinear(torch.randn(8, 16), None)
        assert few.plain_max_rows == linear.MKL_MAX_ROWS  # MKL's sgemv only (none on AVX2-only CPUs)
        assert (few.plain is None) == (linear.MKL_MAX_ROWS == 0)
    int8 = Int8Linear(torch.randn(8, 16), None)
    assert int8.row_sum is None and not int8.weight_only_kernel


@pytest.mark.skipif(not kernels.has("gemm_w8_f32"), reason="only built on AVX2 CPUs without VNNI")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_w8_f32_matches_the_widened_weights(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 100 + shape[0])
    n, k = shape
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) + 0.01
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    ref = F.linear(x.double(), q.double() * scale.double()[:, None], None if b is None else b.double())
    torch.testing.assert_close(torch.ops.tandem.gemm_w8_f32(x, q, scale, b), ref.float(), rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not kernels.has("gemm_w8_f32"), reason="only built on AVX2 CPUs without VNNI")
@pytest.mark.parametrize("rows", [1, 16, 17, 40, 64, 65])
def test_int8_layer_without_vnni_runs_w8a8_then_weight_only(rows):
    """Without VNNI, Int8Linear runs the AVX2 W8A8 kernel to 16 rows (the VNNI kernel's integer
    sums: activations quantized per row), then the weight-only kernel (in 16-row calls up to 64
    rows) and the widened float product above: those two the float reference's values."""
    from tandem.model import quant

    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 72, generator=g), torch.randn(96, generator=g)
    fast, ref = Int8Linear(w, b), Int8Linear(w, b, use_kernel=False)
    assert fast.weight_only_kernel and fast.kernel_max_rows == quant._AVX2_KERNEL_MAX_ROWS == 16
    x = torch.randn(rows, 72, generator=g)
    if rows <= fast.kernel_max_rows:
        x_scale = x.abs().amax(1).clamp(min=1e-12) / 127
        xq = torch.round(x / x_scale[:, None]).clamp(-127, 127).double()
        expect = (xq @ fast.qweight.double().T) * x_scale.double()[:, None] * fast.scale.double() + b.double()
        torch.testing.assert_close(fast(x).double(), expect, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9, 17])
def test_layers_agree_with_and_without_kernels(rows, monkeypatch):
    """The layers' few-row kernel paths and their torch paths give the same products."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(72, 48, generator=g)
    b = torch.randn(72, generator=g)
    x = torch.randn(rows, 48, generator=g)
    on_q = Int8Linear(w, b)
    on_b = PackedLinear(w.to(torch.bfloat16), b.to(torch.bfloat16)) if onednn_available(torch.bfloat16) else None
    on_f = PackedLinear(w, b) if onednn_available() else None
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    off_q = Int8Linear(w, b)
    if on_f is not None:
        torch.testing.assert_close(on_f(x), PackedLinear(w, b)(x), rtol=1e-5, atol=1e-5)
        if rows <= linear.MKL_MAX_ROWS:  # MKL's sgemv either way: the very same bits as F.linear
            assert torch.equal(on_f(x), F.linear(x, w, b))
    ref_q = F.linear(x, on_q.dequantized(torch.float32), b)
    for lin in (on_q, off_q):  # both quantize activations to 8 bits, differently: compare to float
        assert float((lin(x) - ref_q).norm() / ref_q.norm()) < 0.03
    if on_b is not None:
        off_b = PackedLinear(w.to(torch.bfloat16), b.to(torch.bfloat16))
        xb = x.to(torch.bfloat16)
        torch.testing.assert_close(on_b(xb).float(), off_b(xb).float(), rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not onednn_available(), reason="oneDNN packed layers only")
def test_warm_row_counts_runs_each_layer_shape_once_per_row_count(monkeypatch):
    """Warming runs one layer of each distinct shape at every row count oneDNN would take."""
    from tandem.model.linear import warm_row_counts

    shapes = [(24, 16), (24, 16), (16, 24)]
    layers = torch.nn.ModuleList([PackedLinear(torch.randn(*shape), None) for shape in shapes])
    calls: list[tuple[int, int]] = []
    forward = PackedLinear.forward

    def counted(self, x):
        calls.append((id(self), x.shape[0]))
        return forward(self, x)

    monkeypatch.setattr(PackedLinear, "forward", counted)
    warm_row_counts(layers, range(1, 21))
    few = layers[0].plain_max_rows
    expected = {(id(layers[0]), r) for r in range(few + 1, 21)} | {
        (id(layers[2]), r) for r in range(few + 1, 21)
    }
    assert sorted(calls) == sorted(expected)
