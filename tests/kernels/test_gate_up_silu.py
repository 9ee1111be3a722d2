"""SiLU-and-multiply in the AMX gate/up product's epilogue (tandem/model/gate_up.py): the same bits
as the product followed by `silu_mul`, for every row count and both weight formats, and layers
that still answer as plain linear layers after their tiles were re-laid out."""

from __future__ import annotations

import pytest
import torch

from tandem.model.gate_up import deinterleave, interleave_tiles, interleaved_columns
from tandem.model.linear import PackedLinear, amx_tiles_available
from tandem.model.quant import Int8Linear

pytestmark = pytest.mark.skipif(not amx_tiles_available(), reason="needs AMX (and the OS granting it)")

ROWS = [0, 1, 5, 16, 17, 32, 33, 70, 600]  # 600 rows of K 96: more than one block of rows
HIDDEN, INTERMEDIATE = 96, 80  # K: 3 bfloat16 blocks, 1.5 int8 blocks; 5 gate and 5 up tiles


def _gate_up(seed: int) -> tuple[torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g), g


def _inputs(rows: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    # Large enough that some gates fall below -87, where SiLU's reciprocal would be denormal.
    return (torch.randn(rows, HIDDEN, generator=g) * 4).to(dtype)


def test_interleaving_the_tiles_is_packing_the_interleaved_rows():
    w, _ = _gate_up(0)
    for dtype in (torch.bfloat16, torch.int8):
        wd = w.to(dtype)
        tiles = torch.ops.tandem.amx_pack(wd)
        order = interleaved_columns(INTERMEDIATE)
        assert sorted(order.tolist()) == list(range(2 * INTERMEDIATE))
        assert order[:32].tolist() == list(range(16)) + list(range(INTERMEDIATE, INTERMEDIATE + 16))
        assert torch.equal(interleave_tiles(tiles, INTERMEDIATE), torch.ops.tandem.amx_pack(wd[order]))
    y = torch.arange(3 * 2 * INTERMEDIATE).reshape(3, -1)
    assert torch.equal(deinterleave(y[:, order], INTERMEDIATE), y)


@pytest.mark.parametrize("rows", ROWS)
def test_bf16_fused_product_has_the_bits_of_product_then_silu_mul(rows):
    w, g = _gate_up(rows)
    wb = w.to(torch.bfloat16)
    x = _inputs(rows, g, torch.bfloat16)
    separate = torch.ops.tandem.silu_mul(torch.ops.tandem.gemm_amx_bf16(x, torch.ops.tandem.amx_pack(wb), 160, None))
    tiles = interleave_tiles(torch.ops.tandem.amx_pack(wb), INTERMEDIATE)
    fused = torch.ops.tandem.gemm_amx_bf16_silu_mul(x, tiles, INTERMEDIATE)
    assert fused.shape == (rows, INTERMEDIATE) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, separate)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_fused_product_has_the_bits_of_product_then_silu_mul(rows, dtype):
    w, g = _gate_up(rows + 1)
    wq = torch.randint(-127, 128, w.shape, generator=g, dtype=torch.int8)
    scale = torch.rand(w.shape[0], generator=g) * 0.01
    bias = torch.randn(w.shape[0], generator=g)
    row_sum = wq.sum(1, dtype=torch.int32)
    x = _inputs(rows, g, dtype)
    product = torch.ops.tandem.gemm_amx_w8a8(x, torch.ops.tandem.amx_pack(wq), 160, scale, row_sum, bias)
    order = interleaved_columns(INTERMEDIATE)
    fused = torch.ops.tandem.gemm_amx_w8a8_silu_mul(
        x, torch.ops.tandem.amx_pack(wq[order]), INTERMEDIATE, scale[order], row_sum[order], bias[order]
    )
    assert fused.shape == (rows, INTERMEDIATE) and fused.dtype == dtype
    assert torch.equal(fused, torch.ops.tandem.silu_mul(product))


def test_bf16_layer_answers_the_same_before_and_after_fusing():
    w, g = _gate_up(3)
    wb = w.to(torch.bfloat16)
    layer, reference = PackedLinear(wb, None), PackedLinear(wb, None)
    assert layer.fuse_silu(INTERMEDIATE) and layer.interleaved == INTERMEDIATE
    assert layer.fuse_silu(INTERMEDIATE)  # a second call keeps the layout
    for rows in (1, 64, 65, 300):  # past 64 rows: oneDNN's copy, then silu_mul
        x = _inputs(rows, g, torch.bfloat16)
        assert torch.equal(layer(x), reference(x))
        assert torch.equal(layer.silu_mul(x), torch.ops.tandem.silu_mul(reference(x)))


def test_int8_layer_answers_the_same_before_and_after_fusing():
    w, g = _gate_up(4)
    bias = torch.randn(2 * INTERMEDIATE, generator=g)
    layer, reference = Int8Linear(w, bias), Int8Linear(w, bias)
    assert layer.fuse_silu(INTERMEDIATE)
    for rows in (1, 64, 65, 300):  # past 64 rows the activation is a second pass
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rows, g, dtype)
            assert torch.equal(layer(x), reference(x))
            assert torch.equal(layer.silu_mul(x), torch.ops.tandem.silu_mul(reference(x)))


def test_layers_that_cannot_fuse_say_so_and_stay_as_they_were():
    g = torch.Generator().manual_seed(5)
    odd = torch.randn(2 * 40, HIDDEN, generator=g)  # halves of 40 columns: not whole tiles
    assert not PackedLinear(odd.to(torch.bfloat16), None).fuse_silu(40)
    assert not Int8Linear(odd, None).fuse_silu(40)
    w, _ = _gate_up(6)
    with_bias = PackedLinear(w.to(torch.bfloat16), torch.randn(2 * INTERMEDIATE, generator=g).to(torch.bfloat16))
    assert not with_bias.fuse_silu(INTERMEDIATE) and with_bias.interleaved == 0
    float32 = PackedLinear(w, None)  # no tiles for float32 weights
    assert not float32.fuse_silu(INTERMEDIATE)
    fused = PackedLinear(w.to(torch.bfloat16), None)
    assert fused.fuse_silu(INTERMEDIATE) and not fused.fuse_silu(2 * INTERMEDIATE)


def test_a_gated_mlp_runs_the_activation_in_its_product():
    from gated_mlp_checks import assert_mlp_runs_activation_in_product

    x = _inputs(9, torch.Generator().manual_seed(8), torch.bfloat16)
    assert_mlp_runs_activation_in_product(HIDDEN, INTERMEDIATE, x, second_copy=True)


def test_bad_inputs_raise_clear_errors():
    w, _ = _gate_up(9)
    tiles = interleave_tiles(torch.ops.tandem.amx_pack(w.to(torch.bfloat16)), INTERMEDIATE)
    x = torch.randn(2, HIDDEN).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tandem.gemm_amx_bf16_silu_mul(x, tiles, 40)
    with pytest.raises(RuntimeError, match="different shape"):
        torch.ops.tandem.gemm_amx_bf16_silu_mul(x, tiles, 96)
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        torch.ops.tandem.gemm_amx_bf16_silu_mul(x.float(), tiles, INTERMEDIATE)
    with pytest.raises(ValueError, match="intermediate 96"):
        interleave_tiles(torch.ops.tandem.amx_pack(w.to(torch.bfloat16)), 96)
