"""The column-panel layout (tandem/model/panels.py) and its few-row kernels `gemm_bf16_panels` and
`gemm_w8a8_panels` (tandem/kernels/panel_ops.cpp) against exact references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.model.linear import PackedLinear
from tandem.model.linear_report import linear_path
from tandem.model.panels import PANEL, pack_panels, unpack_panels
from tandem.model.quant import Int8Linear

# (out, in): fewer columns than a panel, ragged last panels, more panels than a block of 8 and a
# task's chunk, inputs down to one pair.
SHAPES = [(5, 2), (16, 30), (37, 96), (200, 64), (300, 130)]
needs_kernel = pytest.mark.skipif(not kernels.has("gemm_bf16_panels"), reason="host CPU has no AVX512-BF16")


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
def test_panels_hold_each_weight_once_in_the_documented_place(shape):
    n, k = shape
    w = _weight(n, k, n)
    p = pack_panels(w)
    panels = -(-n // PANEL)
    assert p.shape == (panels, k // 2, PANEL, 2) and p.is_contiguous()
    # Column c of panel q, input pair j: w[16 q + c, 2 j + i].
    q, j, c, i = panels - 1, k // 2 - 1, (n - 1) % PANEL, 1
    assert p[q, j, c, i] == w[PANEL * q + c, 2 * j + i]
    assert torch.equal(unpack_panels(p, n), w)
    assert not p.reshape(-1, k // 2 * PANEL * 2).float().abs().sum().isnan()
    if n % PANEL:  # padding columns are zero
        assert not p[-1, :, n % PANEL :, :].any()


def test_pack_panels_rejects_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="even number of columns"):
        pack_panels(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        pack_panels(torch.zeros(4, 4))


@needs_kernel
@pytest.mark.parametrize("rows", [*range(18), 31, 33, 70])  # past 16: the chunk's panels again per 16 rows
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_bf16_panels_matches_float_reference(rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = _weight(n, k, n)
    p = pack_panels(w)
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    # Products of bfloat16 values are exact in float32; only the summation order differs.
    ref = F.linear(x.to(torch.bfloat16).float(), w.float(), b)
    y32 = torch.ops.tandem.gemm_bf16_panels(x, p, n, b)
    assert y32.dtype == torch.float32 and y32.shape == (rows, n)
    torch.testing.assert_close(y32, ref, rtol=1e-5, atol=1e-4)
    y16 = torch.ops.tandem.gemm_bf16_panels(x.to(torch.bfloat16), p, n, None)
    assert y16.dtype == torch.bfloat16 and y16.shape == (rows, n)
    torch.testing.assert_close(y16.float(), ref - b, rtol=1e-2, atol=1e-2)
    # A strided activation is read as its values.
    xs = x.T.contiguous().T
    torch.testing.assert_close(torch.ops.tandem.gemm_bf16_panels(xs, p, n, b), y32, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(shape):
    """Each output sums its inputs in one order whatever the batch: a stream's logits are the same
    decoding alone or beside 39 others."""
    n, k = shape
    w = _weight(n, k, n + 1)
    p = pack_panels(w)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    together = torch.ops.tandem.gemm_bf16_panels(x, p, n, None)
    for m in (0, 5, 15, 16, 39):
        alone = torch.ops.tandem.gemm_bf16_panels(x[m : m + 1], p, n, None)
        assert torch.equal(alone[0], together[m])
    assert torch.equal(torch.ops.tandem.gemm_bf16_panels(x[3:11], p, n, None), together[3:11])
    assert torch.equal(torch.ops.tandem.gemm_bf16_panels(x[10:37], p, n, None), together[10:37])


@needs_kernel
def test_gemm_bf16_panels_rejects_bad_operands():
    p = pack_panels(_weight(40, 64, 0))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.tandem.gemm_bf16_panels(torch.randn(2, 62), p, 40, None)
    with pytest.raises(RuntimeError, match="do not fill"):
        torch.ops.tandem.gemm_bf16_panels(x, p, 60, None)
    with pytest.raises(RuntimeError, match="one bias per output row"):
        torch.ops.tandem.gemm_bf16_panels(x, p, 40, torch.zeros(39))


@needs_kernel
def test_a_bfloat16_layer_denied_the_tiles_runs_its_few_rows_on_the_panels(monkeypatch):
    """An AMX CPU whose tiles this process may not use: the panels for few rows beside oneDNN."""
    from tandem.model import linear

    monkeypatch.setattr(linear, "amx_tiles_available", lambda: False)
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    layer = PackedLinear(_weight(40, 48, 3), None)
    assert layer.plain is None and layer.panels is not None and layer.packed is not None
    assert layer.plain_max_rows == linear.kernel_max_rows(torch.bfloat16) == 4
    x = torch.randn(layer.plain_max_rows, 48).to(torch.bfloat16)
    assert torch.equal(layer(x), torch.ops.tandem.gemm_bf16_panels(x, layer.panels, 40, None))
    path, nbytes = linear_path(layer)  # what the start-up log says of it
    assert f"gemm_bf16_panels (AVX512-BF16 vdpbf16ps) for <= {layer.plain_max_rows} rows" in path
    assert nbytes >= layer.panels.numel() * 2
    # An odd number of inputs has no panel form: the plain weight and gemv_bf16 instead.
    odd = PackedLinear(_weight(40, 47, 4), None)
    assert odd.panels is None and (odd.plain is not None) == kernels.has("gemv_bf16")


@needs_kernel
@pytest.mark.parametrize("second_copy", [True, False])
def test_without_amx_a_bfloat16_layer_holds_its_panels_alone_for_every_row_count(monkeypatch, second_copy):
    """With AVX512-BF16 and no AMX (an AMD EPYC's flags) the panels take every product: no oneDNN
    copy, whatever the memory rule says of a second one."""
    from tandem.model import linear

    monkeypatch.setattr(linear, "amx_tiles_available", lambda: False)
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "avx512_vnni"}))
    assert not linear.bf16_panels_every_row_count({"avx512_bf16", "amx_bf16"})
    assert not linear.bf16_panels_every_row_count({"avx512f", "avx2"})
    w, b = _weight(40, 48, 5), torch.randn(40)
    layer = PackedLinear(w, b, second_copy)
    assert layer.packed is None and layer.plain is None and layer.tiles is None and layer.panels is not None
    for rows in (1, 16, 17, 70):
        x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        y = layer(x)
        assert torch.equal(y, torch.ops.tandem.gemm_bf16_panels(x, layer.panels, 40, b))
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b), rtol=1e-2, atol=1e-2)
    path, nbytes = linear_path(layer)
    assert path == "gemm_bf16_panels (AVX512-BF16 vdpbf16ps) bfloat16, every row count (one copy)"
    assert nbytes == layer.panels.numel() * 2 + 40 * 4


# int8: inputs in groups of 4 a lane.
INT8_SHAPES = [(5, 4), (16, 32), (37, 96), (200, 64), (300, 132)]
needs_int8_kernel = pytest.mark.skipif(
    not kernels.has("gemm_w8a8_panels"), reason="host CPU has no AVX512-VNNI"
)


def test_int8_panels_round_trip_in_groups_of_four():
    q = torch.randint(-127, 128, (37, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    p = pack_panels(q)
    assert p.shape == (3, 24, PANEL, 4) and p.dtype == torch.int8
    assert p[2, 23, 4, 3] == q[36, 95] and not p[2, :, 5:, :].any()
    assert torch.equal(unpack_panels(p, 37), q)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_panels(torch.zeros(4, 6, dtype=torch.int8))


@needs_int8_kernel
@pytest.mark.parametrize("rows", [*range(18), 31, 33, 70])
@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_gemm_w8a8_panels_matches_the_row_kernel(rows, shape):
    """The same integer sums as gemm_w8a8 (rows quantized alike, +128 offset taken out with the
    columns' sums), so the same results; both against the exact reference of those integers, for
    every row count (past 16 the chunk's panels again per 16 rows)."""
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    layer = Int8Linear(torch.randn(n, k, generator=g), None, use_kernel=False)  # the plain int8 weight
    q, scale, w_sum = layer.qweight, layer.scale, layer.qweight.sum(1, dtype=torch.int32)
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    y = torch.ops.tandem.gemm_w8a8_panels(x, pack_panels(q), n, scale, w_sum, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    x_scale = x.abs().amax(1).clamp(min=1e-12) / 127
    xq = torch.round(x / x_scale[:, None]).clamp(-127, 127).double()
    expect = (xq @ q.double().T) * x_scale.double()[:, None] * scale.double() + b.double()
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-4)
    if kernels.has("gemm_w8a8") and 0 < rows <= 16:  # (the row kernel takes 1 to 16 rows)
        torch.testing.assert_close(y, torch.ops.tandem.gemm_w8a8(x, q, scale, w_sum, b), rtol=1e-6, atol=1e-5)
    # A bfloat16 result is the float32 one rounded to nearest even (with or without AVX512-BF16).
    x16 = x.to(torch.bfloat16)
    y16 = torch.ops.tandem.gemm_w8a8_panels(x16, pack_panels(q), n, scale, w_sum, b)
    assert y16.dtype == torch.bfloat16 and y16.shape == (rows, n)
    y16_as32 = torch.ops.tandem.gemm_w8a8_panels(x16.float(), pack_panels(q), n, scale, w_sum, b)
    assert torch.equal(y16, y16_as32.to(torch.bfloat16))


@needs_int8_kernel
def test_an_int8_layer_without_tiles_holds_its_weight_as_panels_only():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))
    layer, ref = Int8Linear(w, torch.zeros(40)), Int8Linear(w, torch.zeros(40), use_kernel=False)
    if layer.tiles is not None:
        pytest.skip("AMX tiles take every int8 product here")
    # The panels take every row count: no row kernel limit, no library copy of the weight.
    assert layer.qweight is None and layer.panels is not None and layer.kernel_max_rows == 0
    assert layer._qlinear is None and layer._packed is None
    assert torch.equal(layer.int8_weight(), ref.qweight)
    torch.testing.assert_close(layer.dequantized(torch.float32), ref.dequantized(torch.float32))
    x = torch.randn(40, 64).to(torch.bfloat16)
    assert torch.equal(layer(x[:5]), layer(x)[:5])  # a row's result whatever the rows beside it
    assert torch.equal(layer(x), torch.ops.tandem.gemm_w8a8_panels(x, layer.panels, 40, layer.scale, layer.row_sum, layer.bias))
    # int8 activations and a bfloat16 result against the float reference
    torch.testing.assert_close(layer(x).float(), ref(x.float()), rtol=0.05, atol=0.25)
    # other activation dtypes through float32, answered in their own dtype
    y16 = layer(x.to(torch.float16))
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), layer(x.float()), rtol=1e-3, atol=1e-3)
    path, nbytes = linear_path(layer)
    assert "int8 kernel gemm_w8a8_panels (AVX512-VNNI vpdpbusd, weight in column panels, every row count)" in path
    assert nbytes == 48 * 64 + 3 * 40 * 4  # the panels (40 columns padded to 48), scales, sums, bias
