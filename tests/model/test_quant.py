"""Weight-only int8 quantization: the kernel and the plain-torch fallback, and the engine option."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams, kernels
from tandem.config import EngineConfig
from tandem.model import quant
from tandem.model.linear import PackedLinear, amx_tiles_available, onednn_available, pack_linears
from tandem.model.quant import Int8Linear, quantize_model

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]


@pytest.mark.parametrize("rows", [1, 5, 33, 200])
@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_dequantized_weight(rows, use_kernel, bias):
    if use_kernel and not quant.dynamic_int8_available():
        pytest.skip("this torch has no x86 quantized engine")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    lin = Int8Linear(w, b, use_kernel=use_kernel)
    x = torch.randn(rows, 40, generator=g)
    ref = F.linear(x, lin.dequantized(torch.float32), b)
    y = lin(x)
    if use_kernel:  # activations are quantized too: 8 (or 7) bits per tensor
        assert float((y - ref).norm() / ref.norm()) < 0.03
    else:  # weight-only: the same int8 weights, exact up to float rounding
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    # Quantization error itself: at most half a step of each channel's scale per weight.
    err = (lin.dequantized(torch.float32) - w).abs()
    assert bool((err <= lin.scale[:, None] / 2 + 1e-6).all())
    # Leading dimensions and dtype are kept.
    assert lin(x.view(rows, 1, 40)).shape == (rows, 1, 48)
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [5, 40])  # the few-row kernel's rows and the library's
def test_int8_activations_are_quantized_row_by_row(rows):
    """One row a thousand times larger than the rest (a first token's activations often are) costs
    the others no precision: each row gets its own scale, whichever GEMM runs it."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=g)
    lin = Int8Linear(w, None)
    x = torch.randn(rows, 96, generator=g)
    x[0] *= 1000
    ref = F.linear(x, lin.dequantized(torch.float32))
    y = lin(x)
    for r in range(rows):
        assert float((y[r] - ref[r]).norm() / ref[r].norm()) < 0.03, r


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, dtype, bias):
    if not onednn_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    lin = PackedLinear(w, b)
    x = torch.randn(rows, 24, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(lin(x).float(), ref, rtol=tol, atol=tol * 10)
    assert lin(x.view(rows, 1, 24)).shape == (rows, 1, 40)
    if dtype == torch.bfloat16 and amx_tiles_available():  # the tile kernel, no plain copy
        assert lin.tiles is not None and lin.plain is None and lin.panels is None
    elif dtype == torch.bfloat16 and kernels.has("gemm_bf16_panels"):  # the weight in column panels
        assert lin.panels is not None and lin.plain is None
    else:
        assert (lin.plain is not None) == (dtype == torch.float32 or kernels.has("gemv_bf16"))


def test_pack_linears_swaps_float_layers_only():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.float16))
    pack_linears(model)
    if onednn_available():
        assert isinstance(model[0], PackedLinear)
    assert isinstance(model[1], torch.nn.Linear)  # float16 stays on the plain path


def test_int8_zero_rows_and_zero_weights():
    for use_kernel in (False, quant.dynamic_int8_available()):
        lin = Int8Linear(torch.zeros(8, 16), None, use_kernel=use_kernel)
        y = lin(torch.randn(3, 16))
        assert torch.equal(y, torch.zeros(3, 8))
        assert lin(torch.randn(0, 16)).shape == (0, 8)


def test_quantize_model_swaps_every_projection(llama_dir):
    llm = LLM(llama_dir, quantization="int8", num_kv_blocks=64)
    model = llm.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer; LM head
    assert model.embed_tokens.weight.dtype == torch.float32


def test_bad_quantization_is_a_value_error(llama_dir):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(llama_dir), quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(torch.nn.Linear(2, 2), "fp4")


def _teacher_forced(llm: LLM, seqs: list[list[int]]) -> tuple[list[float], list[bool]]:
    """Each token's logprob given the ones before it, and whether it was the model's top choice."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    lps, top = [], []
    for seq, out in zip(seqs, outs):
        for tok, ranked in zip(seq[1:], out.prompt_logprobs[1:]):
            lps.append(ranked[tok].logprob)
            top.append(max(ranked, key=lambda t: ranked[t].logprob) == tok)
    return lps, top


@pytest.mark.slow
def test_int8_default_model_stays_close_to_float():
    """On the trained default model, int8 weights keep each token's logprob close to float's, over
    the prompts and float's own greedy continuations read as one text (teacher-forced, so a near
    tie that sends greedy decoding down another path does not end the comparison)."""
    ref = LLM()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = ref.generate(PROMPTS, params, use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    ref_lps, ref_top = _teacher_forced(ref, seqs)
    for use_kernel in (True, False):
        llm = LLM(quantization="int8")
        for m in llm.engine.core.runner.model.modules():
            if isinstance(m, Int8Linear) and not use_kernel:  # the int8 weights widened to float
                m.qweight = m.int8_weight()
                m._qlinear = m._packed = m.row_sum = m.tiles = m.panels = None
                m.weight_only_kernel = False
                m.bind_tensors()
        lps, top = _teacher_forced(llm, seqs)
        assert not any(math.isnan(v) for v in lps)
        diffs = [abs(a - b) for a, b in zip(lps, ref_lps)]
        # Per-row activation scales stay well inside these bounds; one scale for the whole batch
        # (a large first-token row flattening the others) does not.
        assert sum(diffs) / len(diffs) < 0.04, use_kernel
        assert max(diffs) < 0.3, use_kernel
        assert sum(a == b for a, b in zip(top, ref_top)) >= 0.95 * len(top), use_kernel


@pytest.mark.slow
def test_default_model_layers_are_packed():
    """Without quantization every projection, the tied LM head included, runs through oneDNN."""
    if not onednn_available():
        pytest.skip("no oneDNN in this torch")
    model = LLM().engine.core.runner.model
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(model.lm_head, PackedLinear)
    # float32: the plain path shares the embedding's storage rather than copying it.
    assert model.lm_head.plain.data_ptr() == model.embed_tokens.weight.data_ptr()
