"""The per-token glue kernels (tandem/kernels/layer_ops.cpp) against the PyTorch operators they
replace, and the loader's choice of where they run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams, kernels
from tandem.model.fused_ops import KERNELS, set_fused_ops
from tandem.model.gemma import GemmaRMSNorm
from tandem.model.layers import GatedMLP, RMSNorm, apply_rope, rotate
from tandem.model.llama import Attention

pytestmark = pytest.mark.skipif(not all(kernels.has(op) for op in KERNELS), reason="layer kernels did not build")

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
        return
    # bfloat16: the same roundings as PyTorch's operators; only a float32 sum's order differs, which
    # can move a value across a rounding boundary (one bfloat16 step) now and then; and silu of a
    # very negative gate is -0 there, a negligible -1e-36 here (exp clamped to a finite value).
    step = (ref.float().abs() * 2**-7).clamp(min=1e-30)
    assert ((got.float() - ref.float()).abs() <= step).all()
    assert (got != ref).float().mean() < 0.02


def _strided_heads(g: torch.Generator, tokens: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, dim] as a view of wider rows (as q and k are of the fused projection)."""
    wide = torch.randn(tokens, heads * dim + 24, generator=g).to(dtype)
    return wide[:, 8 : 8 + heads * dim].view(tokens, heads, dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_matches_the_module(dtype, norm_cls):
    g = torch.Generator().manual_seed(1)
    for shape in [(96,), (5, 96), (1, 896), (3, 70)]:
        norm = norm_cls(shape[-1], 1e-6)
        norm.weight.data = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        ref = norm(x)
        norm.fused = True
        _close(norm(x), ref, dtype)
    # q/k norms: per-head rows of a strided [tokens, heads, head_dim] view.
    norm = norm_cls(32, 1e-6)
    norm.weight.data = (torch.rand(32, generator=g) + 0.5).to(dtype)
    x = _strided_heads(g, 4, 3, 32, dtype)
    ref = norm(x)
    norm.fused = True
    _close(norm(x), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_add_then_norm(dtype):
    """The fused residual add + norm: the sum exactly as PyTorch's add rounds it, the norm as the
    module's (also on a strided x, as the attention output can be)."""
    g = torch.Generator().manual_seed(2)
    for tokens, dim in [(1, 896), (5, 96), (3, 70)]:
        norm = RMSNorm(dim, 1e-6)
        norm.weight.data = (torch.rand(dim, generator=g) + 0.5).to(dtype)
        x = (torch.randn(tokens, dim, generator=g) * 3).to(dtype)
        residual = (torch.randn(tokens, dim, generator=g) * 3).to(dtype)
        ref_norm, ref_sum = norm.add_forward(x, residual)  # unfused: residual + x, then the module
        torch.testing.assert_close(ref_sum, residual + x, rtol=0, atol=0)
        norm.fused = True
        got_norm, got_sum = norm.add_forward(x, residual)
        torch.testing.assert_close(got_sum, ref_sum, rtol=0, atol=0)
        _close(got_norm, ref_norm, dtype)
        wide = torch.zeros(tokens, dim + 16, dtype=dtype)
        wide[:, 8 : 8 + dim] = x
        got_norm, got_sum = norm.add_forward(wide[:, 8 : 8 + dim], residual)
        torch.testing.assert_close(got_sum, ref_sum, rtol=0, atol=0)
        _close(got_norm, ref_norm, dtype)


def test_rms_norm_reads_any_weight_dtype_and_layout():
    """The model's float32 and bfloat16 weights are read in place; another dtype or a strided weight
    gives the same result as its float32 copy."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, generator=g)
    w = torch.rand(40, generator=g) + 0.5
    ref = torch.ops.tandem.rms_norm(x, w, 1e-6, 1.0, False)
    torch.testing.assert_close(torch.ops.tandem.rms_norm(x, w.double(), 1e-6, 1.0, False), ref, rtol=0, atol=0)
    strided = torch.stack([w, w], dim=1)[:, 0]
    assert not strided.is_contiguous()
    torch.testing.assert_close(torch.ops.tandem.rms_norm(x, strided, 1e-6, 1.0, False), ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_silu_times_up(dtype):
    g = torch.Generator().manual_seed(2)
    for rows, inter in [(1, 4864), (3, 37), (40, 1000)]:  # 40 x 1000 splits across threads
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        gate_up[0, :6] = torch.tensor([-200.0, -90.0, -1e-30, 0.0, 90.0, 200.0])
        gate, up = gate_up.split(inter, dim=-1)
        _close(torch.ops.tandem.silu_mul(gate_up), F.silu(gate) * up, dtype)
    # Strided rows (a slice of a wider activation) are read as such.
    wide = torch.randn(3, 2 * 64 + 16, generator=g).to(dtype)
    view = wide[:, : 2 * 64]
    _close(torch.ops.tandem.silu_mul(view), F.silu(view[:, :64]) * view[:, 64:], dtype)


def test_the_kernels_leave_denormals_to_pytorch_on_every_thread():
    """The kernels flush denormals while they run (a vectorized SiLU meets one in every lane);
    the calling thread and the pool threads get their floating-point mode back."""
    tiny = torch.full((1 << 20,), 1e-39)  # a denormal float32
    doubled = (tiny * 2.0).view(torch.int32)  # compared as bits: no float comparison to flush
    assert (doubled > 0).all()
    torch.ops.tandem.silu_mul(torch.randn(1, 64))  # on the calling thread
    torch.ops.tandem.silu_mul(torch.randn(64, 4096))  # split over the pool
    assert torch.equal((tiny[:1] * 2.0).view(torch.int32), doubled[:1])  # the calling thread
    assert torch.equal((tiny * 2.0).view(torch.int32), doubled)  # a million: the pool threads too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_in_place_matches_apply_rope(dtype, rotary_dim):
    g = torch.Generator().manual_seed(3)
    tokens, heads, dim = 5, 6, 64
    cos = torch.randn(tokens, 1, rotary_dim, generator=g)
    sin = torch.randn(tokens, 1, rotary_dim, generator=g)
    x = _strided_heads(g, tokens, heads, dim, dtype)
    ref = apply_rope(x, (cos, sin))
    base = x._base
    assert base is not None
    before = base.clone()
    out = rotate(x, (cos, sin), fused=True)
    assert out.data_ptr() == x.data_ptr()  # in place, in the projection's output
    _close(out.contiguous(), ref, dtype)
    # Nothing outside the view moved.
    assert torch.equal(base[:, :8], before[:, :8]) and torch.equal(base[:, 8 + heads * dim :], before[:, 8 + heads * dim :])


def test_layer_kernels_reject_bad_input():
    with pytest.raises(RuntimeError, match="one shape"):
        torch.ops.tandem.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.tandem.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="rms_norm: weight"):
        torch.ops.tandem.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6, 0.0, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tandem.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-6, 0.0, True)
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        torch.ops.tandem.silu_mul(torch.zeros(8, 4).T)
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        torch.ops.tandem.silu_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="one row per token"):
        torch.ops.tandem.rope_(torch.zeros(3, 2, 8), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.tandem.rope_(torch.zeros(3, 2, 8), torch.zeros(3, 1, 5), torch.zeros(3, 1, 5))


def _fused_kinds(llm: LLM) -> set[str]:
    model = llm.engine.core.runner.model
    kinds = set()
    for m in model.modules():
        if isinstance(m, RMSNorm) and m.fused:
            kinds.add("rms_norm")
        if isinstance(m, GatedMLP) and m.fused:
            kinds.add("silu_mul")
        if isinstance(m, Attention) and m.fused_rope:
            kinds.add("rope")
    return kinds


def _greedy(llm: LLM) -> tuple[list[list[int]], list[float]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 77, 41]}, "hello world"], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [d[t].logprob for o in outs for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    return tokens, lps


def test_loader_fuses_all_but_the_exact_float32_path(llama_dir):
    exact = LLM(llama_dir, num_kv_blocks=32)
    assert _fused_kinds(exact) == set()  # float32 with float weights: transformers' exact operators
    assert _fused_kinds(LLM(llama_dir, dtype="bfloat16", num_kv_blocks=32)) == {"rms_norm", "silu_mul", "rope"}
    int8 = LLM(llama_dir, quantization="int8", num_kv_blocks=32)
    assert _fused_kinds(int8) == {"rms_norm", "silu_mul", "rope"}
    # The int8 model's output is that of its PyTorch operators, to float32 rounding.
    tokens, lps = _greedy(int8)
    set_fused_ops(int8.engine.core.runner.model, False)
    ref_tokens, ref_lps = _greedy(int8)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), rtol=0, atol=1e-4)
