"""SiLU-and-multiply in the column-panel gate/up products' epilogue (`gemm_bf16_panels_silu_mul`,
`gemm_w8a8_panels_silu_mul`; tandem/model/gate_up.py): the same bits as the product followed by
`silu_mul` for every row count and both activation dtypes, and layers that still answer as plain
linear layers (and give back their weight) after their panels were re-laid out. The layer tests act as a CPU with AVX512-BF16 and no
AMX (an AMD EPYC's flags), so they run on any host whose kernels have the instruction."""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.model.gate_up import deinterleave, interleave_panels, interleaved_columns
from tandem.model.linear import PackedLinear
from tandem.model.panels import pack_panels
from tandem.model.quant import Int8Linear

needs_bf16 = pytest.mark.skipif(
    not kernels.has("gemm_bf16_panels_silu_mul"), reason="host CPU has no AVX512-BF16"
)

ROWS = [0, 1, 5, 16, 17, 33, 70, 600]  # past 16 rows a chunk's panels are taken again per 16
HIDDEN, INTERMEDIATE = 96, 80  # 5 gate and 5 up panels: pairs split across 2 threads unevenly


def _gate_up(seed: int) -> tuple[torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g).to(torch.bfloat16), g


def _inputs(rows: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    # Large enough that some gates fall below -87, where SiLU's reciprocal would be denormal.
    return (torch.randn(rows, HIDDEN, generator=g) * 4).to(dtype)


@pytest.fixture
def epyc(monkeypatch):
    """PackedLinear as built on a CPU with AVX512-BF16 and no AMX: its panels alone."""
    from tandem.model import linear

    monkeypatch.setattr(linear, "amx_tiles_available", lambda: False)
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "avx512_vnni"}))


def test_interleaving_the_panels_is_packing_the_interleaved_rows():
    w, _ = _gate_up(0)
    order = interleaved_columns(INTERMEDIATE)
    assert torch.equal(interleave_panels(pack_panels(w), INTERMEDIATE), pack_panels(w[order]))
    with pytest.raises(ValueError, match="intermediate 96"):
        interleave_panels(pack_panels(w), 96)


@needs_bf16
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_product_has_the_bits_of_product_then_silu_mul(rows, dtype):
    w, g = _gate_up(rows)
    x = _inputs(rows, g, dtype)
    ops = torch.ops.tandem
    separate = ops.silu_mul(ops.gemm_bf16_panels(x, pack_panels(w), 2 * INTERMEDIATE, None))
    fused = ops.gemm_bf16_panels_silu_mul(x, interleave_panels(pack_panels(w), INTERMEDIATE), INTERMEDIATE)
    assert fused.shape == (rows, INTERMEDIATE) and fused.dtype == dtype
    assert torch.equal(fused, separate)


@needs_bf16
def test_layer_answers_the_same_before_and_after_fusing(epyc):
    w, g = _gate_up(3)
    layer, reference = PackedLinear(w, None), PackedLinear(w, None)
    assert layer.packed is None and layer.panels is not None  # the panels take every row count
    assert layer.fuse_silu(INTERMEDIATE) and layer.interleaved == INTERMEDIATE
    assert layer.fuse_silu(INTERMEDIATE) and not layer.fuse_silu(2 * INTERMEDIATE)
    assert not torch.equal(layer.panels, reference.panels)  # re-laid out, not copied
    for rows in (1, 16, 17, 300):
        x = _inputs(rows, g, torch.bfloat16)
        assert torch.equal(layer(x), reference(x))
        assert torch.equal(layer.silu_mul(x), torch.ops.tandem.silu_mul(reference(x)))


@needs_bf16
def test_layers_that_cannot_fuse_say_so_and_stay_as_they_were(epyc):
    g = torch.Generator().manual_seed(5)
    odd = torch.randn(2 * 40, HIDDEN, generator=g).to(torch.bfloat16)  # halves of 40: not whole panels
    layer = PackedLinear(odd, None)
    before = layer.panels.clone()
    assert not layer.fuse_silu(40) and layer.interleaved == 0 and torch.equal(layer.panels, before)
    w, _ = _gate_up(6)
    with_bias = PackedLinear(w, torch.randn(2 * INTERMEDIATE, generator=g).to(torch.bfloat16))
    assert not with_bias.fuse_silu(INTERMEDIATE) and with_bias.interleaved == 0


@needs_bf16
def test_a_gated_mlp_runs_the_activation_in_its_product(epyc):
    from gated_mlp_checks import assert_mlp_runs_activation_in_product

    x = _inputs(9, torch.Generator().manual_seed(8), torch.bfloat16)
    assert_mlp_runs_activation_in_product(HIDDEN, INTERMEDIATE, x, second_copy=False)


def test_deinterleave_puts_the_halves_back():
    order = interleaved_columns(INTERMEDIATE)
    y = torch.arange(3 * 2 * INTERMEDIATE).reshape(3, -1)
    assert torch.equal(deinterleave(y[:, order], INTERMEDIATE), y)


@needs_bf16
def test_bad_inputs_raise_clear_errors():
    w, _ = _gate_up(9)
    panels = interleave_panels(pack_panels(w), INTERMEDIATE)
    x = torch.randn(2, HIDDEN).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tandem.gemm_bf16_panels_silu_mul(x, panels, 40)
    with pytest.raises(RuntimeError, match="do not fill"):
        torch.ops.tandem.gemm_bf16_panels_silu_mul(x, panels, 96)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.tandem.gemm_bf16_panels_silu_mul(torch.randn(2, 64).to(torch.bfloat16), panels, INTERMEDIATE)


needs_int8 = pytest.mark.skipif(not kernels.has("gemm_w8a8_panels_silu_mul"), reason="host CPU has no AVX512-VNNI")


@needs_int8
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_fused_product_has_the_bits_of_product_then_silu_mul(rows, dtype):
    g = torch.Generator().manual_seed(rows + 1)
    wq = torch.randint(-127, 128, (2 * INTERMEDIATE, HIDDEN), generator=g, dtype=torch.int8)
    scale = torch.rand(2 * INTERMEDIATE, generator=g) * 0.01
    bias = torch.randn(2 * INTERMEDIATE, generator=g)
    row_sum = wq.sum(1, dtype=torch.int32)
    x = _inputs(rows, g, dtype)
    ops = torch.ops.tandem
    product = ops.gemm_w8a8_panels(x, pack_panels(wq), 2 * INTERMEDIATE, scale, row_sum, bias)
    order = interleaved_columns(INTERMEDIATE)
    fused = ops.gemm_w8a8_panels_silu_mul(
        x, pack_panels(wq[order]), INTERMEDIATE, scale[order], row_sum[order], bias[order]
    )
    assert fused.shape == (rows, INTERMEDIATE) and fused.dtype == dtype
    assert torch.equal(fused, ops.silu_mul(product))


@needs_int8
def test_int8_layer_answers_the_same_before_and_after_fusing(monkeypatch):
    from tandem.model import quant

    monkeypatch.setattr(quant, "amx_tiles_available", lambda: False)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g)
    bias = torch.randn(2 * INTERMEDIATE, generator=g)
    layer, reference = Int8Linear(w, bias), Int8Linear(w, bias)
    assert layer.panels is not None and layer.tiles is None
    assert layer.fuse_silu(INTERMEDIATE) and layer.interleaved == INTERMEDIATE
    assert not torch.equal(layer.panels, reference.panels)  # re-laid out
    assert torch.equal(layer.int8_weight(), reference.int8_weight())  # and given back in order
    for rows in (1, 16, 17, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rows, g, dtype)
            assert torch.equal(layer(x), reference(x))
            assert torch.equal(layer.silu_mul(x), torch.ops.tandem.silu_mul(reference(x)))
