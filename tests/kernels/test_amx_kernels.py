"""Tandem's AMX tile kernels (tandem/kernels/amx_ops.cpp) against float references, on shapes that
cross every tile and panel boundary (rows 16/32, columns 16/32, K blocks of 32/64 values)."""

from __future__ import annotations

import pytest
import torch

from tandem.model.linear import PackedLinear, amx_tiles_available
from tandem.model.quant import Int8Linear

pytestmark = pytest.mark.skipif(not amx_tiles_available(), reason="needs AMX (and the OS granting it)")

ROWS = [0, 1, 5, 16, 17, 32, 33, 70]
SHAPES = [(40, 24), (64, 64), (100, 96), (33, 200)]  # (out, in): partial panels, tiles and K blocks


def test_pack_puts_each_value_where_the_tiles_read_it():
    n, k = 40, 70
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    packed = torch.ops.tandem.amx_pack(w.to(torch.int32).to(torch.int8))
    assert packed.shape == (2, 2, 2, 16, 64)  # 2 panels of 32 columns, K 70 -> 2 blocks of 64
    for p, b, t, r, c, j in [(0, 0, 0, 0, 0, 0), (0, 1, 1, 3, 5, 2), (1, 0, 0, 7, 7, 3), (1, 1, 1, 15, 15, 3)]:
        col, kk = p * 32 + t * 16 + c, b * 64 + r * 4 + j
        want = int(w[col, kk].to(torch.int32).to(torch.int8)) if col < n and kk < k else 0
        assert int(packed[p, b, t, r, c * 4 + j]) == want
    bf = torch.ops.tandem.amx_pack(torch.randn(n, k).to(torch.bfloat16))
    assert bf.shape == (2, 3, 2, 16, 32) and bf.dtype == torch.bfloat16  # K 70 -> 3 blocks of 32


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_tiles_match_a_float_product(rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    y = torch.ops.tandem.gemm_amx_bf16(x, torch.ops.tandem.amx_pack(w), n, bias)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    ref = x.float() @ w.float().T + bias
    # float32 sums of exact bfloat16 products, then one rounding to bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=8e-3 * _largest(ref))


def _largest(t: torch.Tensor) -> float:
    return max(t.abs().max().item(), 1.0) if t.numel() else 1.0


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = xf.abs().amax(1).clamp(min=1e-12) / 127.0
    q = torch.round(xf * (1.0 / scale)[:, None]).clamp(-127, 127)
    return q, scale


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_tiles_match_an_exact_integer_product(rows, shape, dtype):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n + 7)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g).to(dtype)
    y = torch.ops.tandem.gemm_amx_w8a8(
        x, torch.ops.tandem.amx_pack(wq), n, w_scale, wq.sum(1, dtype=torch.int32), bias
    )
    assert y.shape == (rows, n) and y.dtype == dtype
    xq, x_scale = _quantized_rows(x)
    dots = (xq.double() @ wq.double().T).float()  # exact: integers well below 2**24
    ref = dots * (w_scale[None, :] * x_scale[:, None]) + bias
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * _largest(ref))


def test_layers_take_the_tile_path_and_agree_with_their_other_paths():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    lin = PackedLinear(w.to(torch.bfloat16), None)
    assert lin.tiles is not None and lin.plain is None
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    onednn = torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")
    torch.testing.assert_close(lin(x).float(), onednn.float(), rtol=1e-2, atol=1e-2)
    q = Int8Linear(w, None)
    assert q.tiles is not None and q._qlinear is None  # tiles for every row count: no library copy
    for rows in (1, 40, 300):
        xr = torch.randn(rows, 64, generator=g)
        xq, x_scale = _quantized_rows(xr)
        ref = (xq.double() @ q.qweight.double().T).float() * (q.scale[None, :] * x_scale[:, None])
        torch.testing.assert_close(q(xr), ref, rtol=1e-5, atol=1e-5 * _largest(ref))


def test_a_layer_held_once_runs_every_row_count_on_its_tiles():
    """Without the second copy a bfloat16 layer on AMX keeps the tiles alone (no oneDNN layout, no
    plain weight) and runs prompt-sized products on them too, agreeing with the two-copy layer."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    once, twice = PackedLinear(w, bias, second_copy=False), PackedLinear(w, bias)
    assert once.packed is None and once.plain is None and once.tiles is not None
    assert twice.packed is not None and twice.tiles is not None
    for rows in (1, 64, 65, 300):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        tiles = torch.ops.tandem.gemm_amx_bf16(x, once.tiles, 96, bias)
        assert torch.equal(once(x), tiles)
        torch.testing.assert_close(once(x).float(), twice(x).float(), rtol=1e-2, atol=2e-2)


def test_layers_no_wider_out_than_in_run_every_row_count_on_tiles():
    """o_proj- and down_proj-like layers (out <= in) hold their tiles alone even with a second copy
    allowed and run prompt-sized products on them; wider layers keep oneDNN's copy for those."""
    g = torch.Generator().manual_seed(2)
    narrow = PackedLinear(torch.randn(64, 96, generator=g).to(torch.bfloat16), None)
    wide = PackedLinear(torch.randn(96, 64, generator=g).to(torch.bfloat16), None)
    assert narrow.packed is None and narrow.tiles is not None
    assert wide.packed is not None and wide.tiles_max_rows == 64
    x = torch.randn(300, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(narrow(x), torch.ops.tandem.gemm_amx_bf16(x, narrow.tiles, 64, None))


def test_bad_inputs_raise_clear_errors():
    w = torch.randn(40, 64).to(torch.bfloat16)
    packed = torch.ops.tandem.amx_pack(w)
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        torch.ops.tandem.gemm_amx_bf16(torch.randn(2, 64), packed, 40, None)
    with pytest.raises(RuntimeError, match="different shape"):
        torch.ops.tandem.gemm_amx_bf16(torch.randn(2, 96).to(torch.bfloat16), packed, 40, None)
    with pytest.raises(RuntimeError, match="different shape"):
        torch.ops.tandem.gemm_amx_bf16(torch.randn(2, 64).to(torch.bfloat16), packed, 80, None)
    with pytest.raises(RuntimeError, match="must come from amx_pack"):
        torch.ops.tandem.gemm_amx_w8a8(
            torch.randn(2, 64), packed, 40, torch.ones(40), torch.zeros(40, dtype=torch.int32), None
        )
    with pytest.raises(RuntimeError, match="must be a 2-D bfloat16 or int8"):
        torch.ops.tandem.amx_pack(torch.randn(4, 4))
