"""The 4-bit kernels (tandem.gemm_int4, tandem.dequant_int4) against pure-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.model.int4 import BLOCK, Int4Linear, dequantize_torch, pack_nibbles

# (out, in, group): several groups, one group per row, a single 32-block, odd output counts,
# odd blocks per group, groups of several chunks.
SHAPES = [
    (40, 64, 32),
    (130, 256, 128),
    (7, 128, 128),
    (33, 96, 32),
    (9, 32, 32),
    (12, 192, 96),  # a pair and an odd block per group
    (21, 640, 640),  # 20 blocks in one group: chunks of 8, 8 and 4
    (18, 256, 64),  # groups of one, two and four units: the fixed-trip kernels
    (10, 512, 256),
]

needs_kernel = pytest.mark.skipif(not kernels.has("gemm_int4"), reason="host CPU has no AVX2 + FMA")


def _weights(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    z = torch.randint(0, 17, (n, k // group), generator=g).float() - torch.rand(n, k // group, generator=g) * 0.5
    return q, s, z


# Blocks of 32 per unit pair and pairs per chunk, as the kernel groups them (cpu_ops.cpp).
CHUNK_BLOCKS = 8
R_SCALE = 16384.0


def block_scales(x: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's effective activation scale per 32-block [m, k / 32]: max|x| / 127 per block,
    held as the chunk's largest scale / 2^14 times a rounded integer (chunks of up to 8 blocks
    within a weight group)."""
    m, k = x.shape
    # float32 as in the kernel, so r rounds the same way
    s = x.float().view(m, k // BLOCK, BLOCK).abs().amax(-1) / 127.0
    out = torch.empty(s.shape, dtype=torch.float64)
    bpg = group // BLOCK
    for g0 in range(0, k // BLOCK, bpg):
        for c0 in range(g0, g0 + bpg, CHUNK_BLOCKS):
            c1 = min(g0 + bpg, c0 + CHUNK_BLOCKS)
            smax = s[:, c0:c1].amax(-1, keepdim=True)
            r = torch.where(smax > 0, torch.round(s[:, c0:c1] / smax * R_SCALE), torch.zeros_like(s[:, c0:c1]))
            out[:, c0:c1] = (smax / R_SCALE).double() * r.double()
    return out


def kernel_reference(x: torch.Tensor, q, s, z, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's scheme in float64: activations to int8 per 32-block (scale max|x| / 127, held
    as the kernel holds it), then the exact product with the dequantized weight."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    # A tensor divided by a tensor: `127.0 / amax` is reciprocal-then-multiply, not IEEE division.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv).double() * block_scales(x, group)[..., None]
    n = q.shape[0]
    w = ((q.double().view(n, k // group, group) - z.double()[..., None]) * s.double()[..., None]).view(n, k)
    y = xq.view(m, k) @ w.T
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_int4_matches_reference(rows, shape, bias):
    n, k, group = shape
    q, s, z = _weights(n, k, group, rows * 7 + n)
    g = torch.Generator().manual_seed(rows)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g) * 2
    x[0, :BLOCK] = 0.0  # an all-zero block: scale 0, no division by it
    packed = pack_nibbles(q)
    zs = (s * z).contiguous()
    y = torch.ops.tandem.gemm_int4(x, packed, s, zs, group, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    ref = kernel_reference(x, q, s, z, group, b)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    # bfloat16 activations: the same product, the result rounded to bfloat16.
    xb = x.to(torch.bfloat16)
    yb = torch.ops.tandem.gemm_int4(xb, packed, s, zs, group, b)
    assert yb.dtype == torch.bfloat16
    refb = kernel_reference(xb.float(), q, s, z, group, b)
    torch.testing.assert_close(yb.double(), refb, rtol=1e-2, atol=2e-2)
    # A strided activation is read correctly.
    xs = torch.randn(k, rows, generator=g).T
    torch.testing.assert_close(
        torch.ops.tandem.gemm_int4(xs, packed, s, zs, group, None).double(),
        kernel_reference(xs, q, s, z, group, None),
        rtol=1e-5,
        atol=1e-4,
    )


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_int4_symmetric_weights_take_no_zs(rows, shape):
    """zs=None means every zero point is 8: the same product as passing zs = 8 * scale."""
    n, k, group = shape
    q, s, _ = _weights(n, k, group, rows + n)
    z = torch.full_like(s, 8.0)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    packed = pack_nibbles(q)
    y = torch.ops.tandem.gemm_int4(x, packed, s, None, group, None)
    torch.testing.assert_close(y.double(), kernel_reference(x, q, s, z, group, None), rtol=1e-5, atol=1e-4)
    out = torch.empty(n, k)
    torch.ops.tandem.dequant_int4(packed, s, None, group, out)
    torch.testing.assert_close(out, dequantize_torch(packed, s, None, group, torch.float32), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, dequantize_torch(packed, s, s * 8, group, torch.float32), rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("group", [256, 512])
def test_gemm_int4_extreme_values_do_not_overflow(group):
    """Every weight 15 and every activation at its block's maximum: the largest 16-bit pair sums
    and int32 chunk sums the kernel can meet, exact against the float64 product."""
    n, k = 8, 1024
    q = torch.full((n, k), 15, dtype=torch.uint8)
    s = torch.full((n, k // group), 0.01)
    z = torch.zeros(n, k // group)
    x = torch.full((2, k), 3.0)
    x[1] = -3.0
    y = torch.ops.tandem.gemm_int4(x, pack_nibbles(q), s, (s * z).contiguous(), group, None)
    expect = torch.tensor([[k * 3.0 * 0.15], [-k * 3.0 * 0.15]]).expand(2, n)
    torch.testing.assert_close(y.double(), expect.double(), rtol=1e-5, atol=1e-3)


@needs_kernel
def test_gemm_int4_activation_error_is_small():
    """Against the float product (no activation rounding): int8 blocks of 32 keep it within 1%."""
    n, k, group = 256, 512, 128
    q, s, z = _weights(n, k, group, 0)
    x = torch.randn(4, k)
    lin = Int4Linear(q, s, z, group, None)
    ref = F.linear(x.double(), dequantize_torch(*lin.weight_parts(), group, torch.float64))
    y = lin(x)
    assert float((y.double() - ref).norm() / ref.norm()) < 0.01


@pytest.mark.skipif(not kernels.has("dequant_int4"), reason="kernels did not build here")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_int4_matches_torch(shape, dtype):
    n, k, group = shape
    q, s, z = _weights(n, k, group, n)
    packed, zs = pack_nibbles(q), (s * z).contiguous()
    out = torch.empty(n, k, dtype=dtype)
    got = torch.ops.tandem.dequant_int4(packed, s, zs, group, out)
    assert got.data_ptr() == out.data_ptr()
    ref = dequantize_torch(packed, s, zs, group, torch.float32)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.to(dtype).float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not kernels.load(), reason="kernels did not build here")
def test_int4_kernels_reject_bad_input():
    q, s, z = _weights(8, 64, 32, 0)
    packed, zs = pack_nibbles(q), s * z
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tandem.dequant_int4(packed, s, zs, 48, torch.empty(8, 64))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tandem.dequant_int4(packed, s.double(), zs, 32, torch.empty(8, 64))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tandem.dequant_int4(packed, s, zs, 32, torch.empty(64, 8).T)
    if kernels.has("gemm_int4"):
        with pytest.raises(RuntimeError, match="columns"):
            torch.ops.tandem.gemm_int4(torch.zeros(1, 32), packed, s, zs, 32, None)
        with pytest.raises(RuntimeError, match="float32 or bfloat16"):
            torch.ops.tandem.gemm_int4(torch.zeros(1, 64, dtype=torch.float64), packed, s, zs, 32, None)


@pytest.mark.parametrize("rows", [1, 4, 9, 40])
def test_int4_linear_paths_agree(rows, monkeypatch):
    """Kernel (few rows), compiled dequantize (more rows) and the kernel-free torch path."""
    n, k, group = 72, 128, 64
    q, s, z = _weights(n, k, group, rows)
    g = torch.Generator().manual_seed(rows)
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    on = Int4Linear(q, s, z, group, b)
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    off = Int4Linear(q, s, z, group, b)
    assert off.kernel_max_rows == 0 and not off.compiled_dequant
    ref = F.linear(x.double(), off.dequantized(torch.float64), b.double())
    torch.testing.assert_close(off(x).double(), ref, rtol=1e-5, atol=1e-5)
    y = on(x)
    if rows <= on.kernel_max_rows or on.panels is not None:  # int8 activation blocks
        assert float((y.double() - ref).norm() / ref.norm()) < 0.01
    else:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert on(x.view(rows, 1, k)).shape == (rows, 1, n)
    assert on(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_fused_int4_layers_keep_zero_points_only_where_needed():
    """q/k/v fused from symmetric parts stores no zs; one asymmetric part makes it store them all."""
    from tandem.model.int4 import fuse_int4

    n, k, group = 16, 128, 64
    parts = []
    for seed, sym in [(0, True), (1, True), (2, False)]:
        q, s, z = _weights(n, k, group, seed)
        parts.append(Int4Linear(q, s, torch.full_like(z, 8.0) if sym else z, group, None))
    def zero_terms(layer: Int4Linear) -> torch.Tensor | None:
        return layer.weight_parts()[2]

    assert zero_terms(parts[0]) is None and zero_terms(parts[2]) is not None
    x = torch.randn(3, k)
    for chosen in (parts[:2], parts):
        fused = fuse_int4(chosen, None)
        assert (zero_terms(fused) is None) == all(zero_terms(p) is None for p in chosen)
        expect = torch.cat([p(x) for p in chosen], dim=-1)
        torch.testing.assert_close(fused(x), expect, rtol=1e-5, atol=1e-5)


def test_int4_linear_follows_its_tensors_when_they_are_replaced():
    """forward reads its tensors from one bound tuple; `.to()`-style replacement refreshes it."""
    q, s, z = _weights(16, 128, 64, 3)
    bias = torch.randn(16)
    lin = Int4Linear(q, s, z, 64, bias)
    x = torch.randn(2, 128)
    before = lin(x)
    lin._apply(lambda t: t.clone())
    assert lin._tensors[0] is lin.qweight and lin._tensors[3] is lin.bias and lin._tensors[5] is lin.panels
    with torch.no_grad():
        lin.bias.zero_()  # the new bias: forward must see it
    torch.testing.assert_close(lin(x), before - bias, rtol=1e-5, atol=1e-5)



def _amx_int4() -> bool:
    return kernels.has("gemm_amx_int4") and bool(torch.ops.tandem.amx_ready())


needs_amx_int4 = pytest.mark.skipif(not _amx_int4(), reason="needs AMX (and the OS granting it)")


@needs_amx_int4
@pytest.mark.parametrize("shape", [*SHAPES, (100, 576, 32), (45, 1536, 128)])
@pytest.mark.parametrize("rows", [1, 9, 17, 33, 70])
@pytest.mark.parametrize("symmetric", [False, True])
def test_amx_int4_matches_dequantized_product(shape, rows, symmetric):
    """The AMX form multiplies exactly the bfloat16 weight dequant_int4 makes (float32
    accumulation, so only the sum's order and the output's rounding differ): every column of
    every panel, a partial last panel, bias, groups of one to twenty blocks, with and without zs."""
    n, k, group = shape
    q, s, z = _weights(n, k, group, rows)
    if symmetric:
        z = torch.full_like(z, 8.0)
    g = torch.Generator().manual_seed(rows + 1)
    b = torch.randn(n, generator=g)
    layer = Int4Linear(q, s, z, group, b)
    assert (layer.zs is None) == symmetric
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = layer.dequantized(torch.bfloat16)
    ref = F.linear(x.double(), w.double(), b.double())
    got = torch.ops.tandem.gemm_amx_int4(x, layer.qweight, layer.scales, layer.zs, group, layer.bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # bfloat16 output: half a unit in the last place of 8 bits, relative to each value's size.
    torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-3 * float(ref.abs().max()))


@needs_amx_int4
def test_int4_linear_routes_rows_to_their_paths(monkeypatch):
    """On AMX, few bfloat16 rows go to the 4-bit kernel, up to `amx_max_rows` to the AMX form, more
    to dequantize-then-GEMM; float32 rows never to the AMX form (it takes bfloat16 only): the
    kernel keeps them up to its own limit (a float32 engine's 13-16-row steps were dequantizing
    every layer's whole weight)."""
    from tandem.model import int4

    layer = Int4Linear(*_weights(64, 128, 32, 0), 32, None)
    assert layer.kernel_max_rows == int4.INT4_KERNEL_MAX_ROWS and layer.amx_max_rows == int4.INT4_AMX_MAX_ROWS
    assert layer.amx_min_rows == int4.INT4_AMX_KERNEL_MAX_ROWS < layer.kernel_max_rows
    assert "AMX" in layer.path()
    calls: list[str] = []
    real = torch.ops.tandem
    for name in ("gemm_int4", "gemm_amx_int4", "dequant_int4"):
        op = getattr(real, name)
        monkeypatch.setattr(
            int4.torch.ops.tandem, name, lambda *a, _op=op, _n=name: calls.append(_n) or _op(*a), raising=False
        )
    for rows, dtype, want in [
        (layer.amx_min_rows, torch.bfloat16, "gemm_int4"),
        (layer.amx_min_rows + 1, torch.bfloat16, "gemm_amx_int4"),
        (layer.amx_max_rows, torch.bfloat16, "gemm_amx_int4"),
        (layer.amx_max_rows + 1, torch.bfloat16, "dequant_int4"),
        (layer.kernel_max_rows, torch.float32, "gemm_int4"),
        (layer.kernel_max_rows + 1, torch.float32, "dequant_int4"),
    ]:
        calls.clear()
        layer(torch.randn(rows, 128, dtype=dtype))
        assert calls == [want], (rows, dtype, calls)
