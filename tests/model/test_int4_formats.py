"""The checkpoint writers (tandem/checkpoints/quantize.py) against the readers
(tandem/model/int4_formats.py) on random shapes and group sizes, and the internal 4-bit layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.checkpoints.quantize import Scheme, pack_int32, quantize_tensor
from tandem.model.int4 import Int4Linear, dequantize_torch, pack_nibbles, unpack_nibbles
from tandem.model.int4_formats import (
    AWQ_PACK_ORDER,
    dequantize_fp8,
    read_awq,
    read_compressed_tensors,
    read_gptq,
    unpack_int32,
)

PREFIX = "model.layers.0.mlp.down_proj"


def _dequant(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    g = s.shape[1]
    return ((q.float().view(n, g, k // g) - z[..., None]) * s[..., None]).reshape(n, k)


def _read(method: str, t: dict[str, torch.Tensor], group: int | None, scheme: Scheme):
    p = PREFIX
    if method == "awq":
        return read_awq(p, t[f"{p}.qweight"], t[f"{p}.qzeros"], t[f"{p}.scales"], group)
    if method == "gptq":
        return read_gptq(p, t[f"{p}.qweight"], t[f"{p}.qzeros"], t[f"{p}.scales"], t[f"{p}.g_idx"], group,
                         v1=scheme.gptq_format == "gptq")
    return read_compressed_tensors(p, t[f"{p}.weight_packed"], t[f"{p}.weight_scale"],
                                   t.get(f"{p}.weight_zero_point"), t[f"{p}.weight_shape"], t.get(f"{p}.weight_g_idx"))


int4_cases = st.tuples(
    st.sampled_from(["awq", "gptq", "ct-int4"]),
    st.integers(1, 6).map(lambda n: 8 * n),  # out features
    st.sampled_from([32, 64, 128, -1]),  # group size
    st.integers(1, 4),  # groups (in features = groups * group size, or 32 * groups per channel)
    st.booleans(),  # symmetric
    st.sampled_from(["gptq", "gptq_v2"]),
    st.booleans(),  # act-order (gptq, ct-int4)
    st.integers(0, 2**16),
)


@settings(max_examples=60, deadline=None)
@given(int4_cases)
def test_int4_writers_and_readers_round_trip(case):
    method, out_f, group, groups, sym, gptq_format, desc_act, seed = case
    if method == "awq":
        sym = desc_act = False  # AutoAWQ GEMM always has zero points and no act-order
    in_f = 32 * groups if group == -1 else group * groups
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)
    scheme = Scheme(method, group, sym, gptq_format, desc_act=desc_act)
    tensors, deq = quantize_tensor(PREFIX, w, scheme)
    q, s, z, perm = _read(method, tensors, None if group == -1 else group, scheme)
    # Act-order with more than one group permutes the inputs; one group needs no order.
    assert (perm is not None) == (desc_act and s.shape[1] > 1)
    if perm is not None:  # the grouped order: dequantize there, compare in the checkpoint's order
        inv = torch.argsort(perm)
        q_grouped = q[:, perm]
        torch.testing.assert_close(_dequant(q_grouped, s, z)[:, inv], deq, rtol=0, atol=1e-6)
        lin = Int4Linear(q, s, z, in_f // s.shape[1], None, use_kernel=False, in_perm=perm)
        torch.testing.assert_close(lin.dequantized(torch.float32)[:, inv], deq, rtol=0, atol=1e-6)
        x = torch.randn(3, in_f, generator=g)
        # The layer sums in the grouped order: float32 rounding grows with the sum of |x w| over
        # up to 512 inputs, so the bound scales with it.
        bound = 1e-6 * (x.abs() @ deq.abs().T).max().item()
        torch.testing.assert_close(lin(x), x @ deq.T, rtol=1e-5, atol=max(1e-5, bound))
        return
    assert q.shape == (out_f, in_f) and q.dtype == torch.uint8 and int(q.max()) <= 15
    assert s.shape == z.shape == (out_f, 1 if group == -1 else groups)
    torch.testing.assert_close(_dequant(q, s, z), deq, rtol=0, atol=1e-6)
    if sym:
        assert bool((z == 8).all())
    # The internal layout keeps the same weight (Int4Linear's torch path is the dequantized product).
    lin = Int4Linear(q, s, z, in_f // s.shape[1], None, use_kernel=False)
    torch.testing.assert_close(lin.dequantized(torch.float32), deq, rtol=0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**16))
def test_internal_nibble_layout_round_trips(rows, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, 32 * blocks), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (rows, 16 * blocks)
    # Byte j of a block: element j in the low nibble, element j + 16 in the high one.
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 16]) << 4
    assert torch.equal(unpack_nibbles(packed), q)


def test_int32_packing_is_the_published_bit_order():
    values = torch.arange(8, dtype=torch.uint8).view(1, 8)
    word = pack_int32(values)
    assert int(word) == 0x76543210
    assert torch.equal(unpack_int32(word), values)
    # A word with the top nibble set is a negative int32, read back unsigned.
    top = pack_int32(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]]))
    assert int(top) < 0 and int(unpack_int32(top)[0, 7]) == 15


def test_awq_interleaved_order():
    """Column j of each eight sits in nibble AWQ_PACK_ORDER.index(j): columns 0..7 are written
    as nibbles holding 0, 2, 4, 6, 1, 3, 5, 7."""
    q = torch.arange(8, dtype=torch.uint8).repeat(32, 1)  # [in=32, out=8], column j holds j
    w = torch.zeros(8, 32)
    tensors, _ = quantize_tensor(PREFIX, w, Scheme("awq", 32))
    word = int(tensors[f"{PREFIX}.qzeros"][0, 0])
    assert word == 0  # all-zero weights: zero points 0 everywhere
    packed = pack_int32(q[:, list(AWQ_PACK_ORDER)])
    assert int(packed[0, 0]) & 0xF == 0 and (int(packed[0, 0]) >> 4) & 0xF == 2
    q_out, _, _, _ = read_awq(PREFIX, packed, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 8), 32)
    assert torch.equal(q_out, q.T)


def test_gptq_v1_zeros_are_stored_minus_one():
    w = torch.randn(8, 32)
    v1, _ = quantize_tensor(PREFIX, w, Scheme("gptq", 32, sym=True, gptq_format="gptq"))
    v2, _ = quantize_tensor(PREFIX, w, Scheme("gptq", 32, sym=True, gptq_format="gptq_v2"))
    assert int(v1[f"{PREFIX}.qzeros"][0, 0]) == 0x77777777  # symmetric: zero 8 stored as 7
    assert int(v2[f"{PREFIX}.qzeros"][0, 0]) == -0x77777778  # 0x88888888 as int32


@pytest.mark.parametrize("block", [None, (32, 48), (128, 128)])
@pytest.mark.parametrize("method", ["fp8", "ct-fp8"])
def test_fp8_round_trip(block, method):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(72, 100, generator=g)
    tensors, deq = quantize_tensor(PREFIX, w, Scheme(method, fp8_block=block))
    f8 = tensors[f"{PREFIX}.weight"]
    scale = tensors.get(f"{PREFIX}.weight_scale_inv", tensors.get(f"{PREFIX}.weight_scale"))
    assert f8.dtype == torch.float8_e4m3fn and scale is not None
    got = dequantize_fp8(PREFIX, f8, scale, block, torch.float32)
    torch.testing.assert_close(got, deq, rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: within 1/16 relative of each scale's range.
    assert float((got - w).abs().max()) <= float(w.abs().max()) / 16
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(PREFIX, w, scale, block, torch.float32)


def test_reader_shape_errors_name_the_tensor():
    w = torch.randn(16, 64)
    t, _ = quantize_tensor(PREFIX, w, Scheme("gptq", 32))
    with pytest.raises(ValueError, match=r"down_proj\.scales has shape"):
        read_gptq(PREFIX, t[f"{PREFIX}.qweight"], t[f"{PREFIX}.qzeros"], t[f"{PREFIX}.scales"][:1], None, 32, True)
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        read_gptq(PREFIX, t[f"{PREFIX}.qweight"], t[f"{PREFIX}.qzeros"], t[f"{PREFIX}.scales"], None, 48, True)
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        Int4Linear(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1), 48, None)


def test_dequantize_torch_matches_the_formula():
    q = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    s, z = torch.rand(4, 2), torch.randint(0, 16, (4, 2)).float()
    got = dequantize_torch(pack_nibbles(q), s, s * z, 32, torch.float64)
    torch.testing.assert_close(got, _dequant(q, s, z).double(), rtol=1e-6, atol=1e-6)
