"""4-bit weights in column panels (tandem/model/panels.py) and `tandem.gemm_int4_panels`
(tandem/kernels/panel_ops.cpp), the product 4-bit layers run on AVX512-VNNI CPUs without AMX."""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.model.int4 import BLOCK, Int4Linear, fuse_int4, pack_nibbles
from tandem.model.linear_report import linear_path
from tandem.model.panels import (
    PANEL,
    pack_group_panels,
    pack_int4_panels,
    unpack_group_panels,
    unpack_int4_panels,
)

# (out, in, group): fewer columns than a panel, ragged last panels, more panels than a block and a
# chunk of 8, one group per row, groups of one to twenty blocks.
SHAPES = [(5, 32, 32), (40, 64, 32), (130, 256, 128), (33, 96, 32), (12, 192, 96), (21, 640, 640), (150, 512, 64)]
needs_kernel = pytest.mark.skipif(not kernels.has("gemm_int4_panels"), reason="host CPU has no AVX512-VNNI")


def _weights(n: int, k: int, group: int, seed: int, symmetric: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    z = torch.full_like(s, 8.0) if symmetric else torch.rand(n, k // group, generator=g) * 15
    return q, s, z


def test_int4_panels_hold_each_nibble_in_the_documented_place():
    n, k = 37, 96
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    p = pack_int4_panels(q)
    assert p.shape == (3, k // 8, PANEL, 4) and p.dtype == torch.uint8 and p.is_contiguous()
    # Column c of panel i, lane j, byte b: input 8j + b low, 8j + 4 + b high.
    for i, j, c, b in [(0, 0, 0, 0), (1, 5, 7, 3), (2, 11, 4, 2)]:
        byte = int(p[i, j, c, b])
        assert byte & 0x0F == q[PANEL * i + c, 8 * j + b] and byte >> 4 == q[PANEL * i + c, 8 * j + 4 + b]
    assert not p[2, :, n % PANEL :, :].any()  # padding columns are zero
    assert torch.equal(unpack_int4_panels(p, n), q)
    s = torch.rand(n, 3)
    sp = pack_group_panels(s)
    assert sp.shape == (3, 3, PANEL) and sp[1, 2, 5] == s[21, 2] and not sp[2, :, 5:].any()
    assert torch.equal(unpack_group_panels(sp, n), s)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4_panels(torch.zeros(4, 12, dtype=torch.uint8))


def panels_reference(x, q, s, z, group, bias):
    """The kernel's scheme in float64: activations to int8 per 32-block (scale max|x| / 127 in
    float32, rounded to nearest even), then the exact product with the dequantized weight."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv).double() * (amax / 127.0).double()
    n = q.shape[0]
    w = ((q.double().view(n, k // group, group) - z.double()[..., None]) * s.double()[..., None]).view(n, k)
    y = xq.view(m, k) @ w.T
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 13, 16, 17, 35])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_gemm_int4_panels_matches_its_scheme(rows, shape, symmetric):
    """Every row count (two passes from 9 rows, several kernel calls from 17), symmetric weights
    (zero taken out in integers) and zero points, bias, a ragged last panel."""
    n, k, group = shape
    q, s, z = _weights(n, k, group, rows * 31 + n, symmetric)
    g = torch.Generator().manual_seed(rows)
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g) * 2
    if rows:
        x[0, :BLOCK] = 0.0  # an all-zero block: scale 0
    qp, sp = pack_int4_panels(q), pack_group_panels(s)
    zp = None if symmetric else pack_group_panels(s * z)
    y = torch.ops.tandem.gemm_int4_panels(x, qp, n, sp, zp, group, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    ref = panels_reference(x, q, s, z, group, b)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    # bfloat16 in and out: the float32 product of the same values, rounded to nearest even.
    xb = x.to(torch.bfloat16)
    yb = torch.ops.tandem.gemm_int4_panels(xb, qp, n, sp, zp, group, b)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, torch.ops.tandem.gemm_int4_panels(xb.float(), qp, n, sp, zp, group, b).to(torch.bfloat16))
    # A strided activation is read correctly.
    xs = torch.randn(k, rows, generator=g).T
    torch.testing.assert_close(
        torch.ops.tandem.gemm_int4_panels(xs, qp, n, sp, zp, group, None).double(),
        panels_reference(xs, q, s, z, group, None), rtol=1e-5, atol=1e-4,
    )


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    n, k, group = 150, 512, 64
    q, s, z = _weights(n, k, group, 0, False)
    qp, sp, zp = pack_int4_panels(q), pack_group_panels(s), pack_group_panels(s * z)
    x = torch.randn(40, k)
    whole = torch.ops.tandem.gemm_int4_panels(x, qp, n, sp, zp, group, None)
    for rows in (1, 5, 12, 16, 17, 33):
        assert torch.equal(torch.ops.tandem.gemm_int4_panels(x[:rows], qp, n, sp, zp, group, None), whole[:rows])


@needs_kernel
def test_gemm_int4_panels_rejects_bad_operands():
    q, s, _ = _weights(40, 64, 32, 0, True)
    qp, sp = pack_int4_panels(q), pack_group_panels(s)
    op = torch.ops.tandem.gemm_int4_panels
    with pytest.raises(RuntimeError, match="columns"):
        op(torch.zeros(1, 32), qp, 40, sp, None, 32, None)
    with pytest.raises(RuntimeError, match="do not fill"):
        op(torch.zeros(1, 64), qp, 60, sp, None, 32, None)
    with pytest.raises(RuntimeError, match=r"scales and zs must be"):
        op(torch.zeros(1, 64), qp, 40, sp[:, :1].contiguous(), None, 32, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.zeros(1, 64), qp, 40, sp, None, 48, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        op(torch.zeros(1, 64, dtype=torch.float64), qp, 40, sp, None, 32, None)


@needs_kernel
@pytest.mark.parametrize("symmetric", [True, False])
def test_a_4bit_layer_without_tiles_holds_its_weight_as_panels_only(symmetric):
    n, k, group = 72, 128, 64
    q, s, z = _weights(n, k, group, 2, symmetric)
    b = torch.randn(n)
    layer, ref = Int4Linear(q, s, z, group, b), Int4Linear(q, s, z, group, b, use_kernel=False)
    if layer.amx_max_rows:
        pytest.skip("AMX hosts keep the row layout for the tile kernel")
    assert layer.qweight is None and layer.scales is None and layer.zs is None and layer.panels is not None
    assert (layer.panel_zs is None) == symmetric
    qweight, scales, zs = layer.weight_parts()
    assert torch.equal(qweight, pack_nibbles(q)) and torch.equal(scales, ref.scales)
    assert (zs is None and ref.zs is None) or torch.equal(zs, ref.zs)
    for rows in (1, 16, 40):  # every row count through the panels, int8 activation blocks
        x = torch.randn(rows, k)
        y, expect = layer(x), ref(x).double()
        assert float((y.double() - expect).norm() / expect.norm()) < 0.01
        assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    torch.testing.assert_close(layer.dequantized(torch.float32), ref.dequantized(torch.float32))
    path, nbytes = linear_path(layer)
    assert "int4 kernel gemm_int4_panels (AVX512-VNNI vpdpbusd" in path
    padded = -(-n // PANEL) * PANEL  # columns, the last panel's padding included
    groups = padded * k // group
    assert nbytes == padded * k // 2 + groups * 4 * (1 if symmetric else 2) + n * 4  # weight once, bias
    # Fused layers (q/k/v, gate/up) read their parts back from the panels.
    other = Int4Linear(*_weights(n, k, group, 3, symmetric), group, None)
    fused = fuse_int4([layer, other], None)
    x = torch.randn(3, k)
    torch.testing.assert_close(fused(x), torch.cat([layer(x) - b, other(x)], dim=-1), rtol=1e-5, atol=1e-5)
    assert fused.panels is not None


@needs_kernel
@pytest.mark.parametrize("symmetric", [True, False])
def test_float16_group_vectors_give_the_float32_results(symmetric):
    """Scales and zero terms that are exactly float16 (GGUF's, most GPTQ / AWQ files') are held as
    float16: the same products as float32 vectors, bit for bit, in fewer bytes; a layer whose values
    are not all float16 keeps float32."""
    n, k, group = 150, 512, 32
    q, s, z = _weights(n, k, group, 7, symmetric)
    s = s.half().float()
    # zero points 1, 2, 4 or 8: s x z keeps s's 11 significant bits, exactly float16 (as GGUF's
    # minimums are; an AWQ scale x zero generally is not, and keeps float32)
    z = 2.0 ** torch.randint(0, 4, s.shape, generator=torch.Generator().manual_seed(8)).float()
    qp, sp = pack_int4_panels(q), pack_group_panels(s)
    zp = None if symmetric else pack_group_panels(s * z)
    x = torch.randn(20, k)
    y32 = torch.ops.tandem.gemm_int4_panels(x, qp, n, sp, zp, group, None)
    y16 = torch.ops.tandem.gemm_int4_panels(x, qp, n, sp.half(), None if zp is None else zp.half(), group, None)
    assert torch.equal(y16, y32)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        torch.ops.tandem.gemm_int4_panels(x, qp, n, sp.half(), pack_group_panels(s * z), group, None)
    layer = Int4Linear(q, s, z if not symmetric else torch.full_like(s, 8.0), group, None)
    if layer.amx_max_rows:
        pytest.skip("AMX hosts keep the row layout for the tile kernel")
    assert layer.panel_scales.dtype == torch.float16 and (symmetric or layer.panel_zs.dtype == torch.float16)
    assert torch.equal(layer.weight_parts()[1], s)
    torch.testing.assert_close(layer(x), y32, rtol=0, atol=0)
    kept = Int4Linear(q, s + 1e-5, torch.full_like(s, 8.0), group, None)  # not float16 values
    assert kept.panel_scales.dtype == torch.float32
