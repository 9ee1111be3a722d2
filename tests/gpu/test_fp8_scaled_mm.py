"""FP8 checkpoints through `torch._scaled_mm` (tandem/model/fp8_linear.py).

torch's CPU build runs `_scaled_mm` (row-wise scales included), so the layer and the loader's
assembly of fused layers run here for real; what only CUDA enforces (operand layouts, scale shapes,
multiples of 16) is checked by a wrapper around the real function. The `gpu`-marked tests run the
same on a GPU's `_scaled_mm`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem import LLM, SamplingParams
from tandem.checkpoints.quantize import Scheme, write_quantized
from tandem.config import ModelConfig
from tandem.model.fp8_linear import (
    FP8_MATMUL_ENV,
    Fp8Linear,
    fp8_weight_path,
    quantize_rows,
    row_scales,
)
from tandem.model.linear_report import linear_report
from tandem.model.loader import load_model

pytest.importorskip("triton")

DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
GPU_KV = {"kv_cache_memory": 64 << 20} if DEVICE == "cuda" else {}
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a value by at most 2^-4 of itself (the
# largest value of each row maps to 448 exactly, so no row saturates).
E4M3_REL = 2.0**-4
SCHEMES = {
    "fp8-tensor": Scheme("fp8", fp8_block=None),  # one scale per tensor: q/k/v fused with three
    "ct-fp8-channel": Scheme("ct-fp8", fp8_block=None),
    "fp8-block": Scheme("fp8", fp8_block=(32, 48)),
}
LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _cuda_checked_scaled_mm(calls: list[tuple[int, int, int]]):
    """`torch._scaled_mm` after checking the operands as CUDA's implementation demands them."""

    def matmul(a, b, *, scale_a, scale_b, out_dtype):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert a.is_contiguous(), "first operand must be row-major"
        assert b.stride() == (1, k), f"second operand must be column-major, strides {b.stride()}"
        assert k % 16 == 0 and n % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert tuple(scale_a.shape) == (m, 1) and scale_a.is_contiguous()
        assert tuple(scale_b.shape) == (1, n) and scale_b.is_contiguous()
        calls.append((m, k, n))
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    return matmul


def _random_fp8_layer(out_f: int, in_f: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    scale = w.abs().amax(dim=1) / 448
    q = (w / scale[:, None]).to(torch.float8_e4m3fn)
    bias = torch.randn(out_f, generator=g)
    return q.to(device), scale.to(device), bias.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_within_activation_rounding_of_the_dequantized_product(dtype):
    q, scale, bias = _random_fp8_layer(96, 64, 0)
    calls: list[tuple[int, int, int]] = []
    lin = Fp8Linear(q, scale, bias.to(dtype), _cuda_checked_scaled_mm(calls))
    x = (torch.randn(2, 5, 64) * torch.logspace(-2, 1, 64)).to(dtype)  # ragged magnitudes per input
    y = lin(x)
    assert y.shape == (2, 5, 96) and y.dtype == dtype
    assert calls == [(10, 64, 96)]
    w = q.float() * scale[:, None]
    xf = x.float().reshape(-1, 64)
    ref = xf @ w.T + bias
    # Only the activation is rounded (the weight is the checkpoint's own): each term of a dot
    # product moves by at most E4M3_REL of itself; then the output's own rounding.
    bound = E4M3_REL * (xf.abs() @ w.abs().T) + ref.abs() * (2e-6 if dtype == torch.float32 else 2**-8)
    err = (y.float().reshape(-1, 96) - ref).abs()
    assert (err <= bound + 1e-6).all()
    # ... and it is the exact product of the rounded activation with the weight, up to float32 sums.
    qa, sa = quantize_rows(x.reshape(-1, 64))
    exact = (qa.float() * sa) @ w.T + bias
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(y.float().reshape(-1, 96), exact, rtol=tol, atol=tol)


def test_quantize_rows_maps_each_rows_largest_value_to_e4m3s_largest():
    x = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [3.0, 1e-3, -3.0]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 1)
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]
    torch.testing.assert_close(s[:, 0], torch.tensor([2.0 / 448, 1e-12, 3.0 / 448]))
    assert torch.equal(q[1].float(), torch.zeros(3))  # an all-zero (padding) row stays zero, not NaN


def test_row_scales_of_each_checkpoint_layout():
    assert torch.equal(row_scales("w", torch.tensor(0.5), 3), torch.full((3,), 0.5))
    assert torch.equal(row_scales("w", torch.tensor([0.5]), 2), torch.full((2,), 0.5))
    assert torch.equal(row_scales("w", torch.tensor([[1.0], [2.0]]), 2), torch.tensor([1.0, 2.0]))
    assert torch.equal(row_scales("w", torch.tensor([1.0, 2.0]), 2), torch.tensor([1.0, 2.0]))
    assert row_scales("w", torch.ones(2, 3), 64) is None  # blocks


def test_fp8_path_choice(monkeypatch):
    monkeypatch.delenv(FP8_MATMUL_ENV, raising=False)
    assert fp8_weight_path(torch.device("cpu"))[0] == "widen"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    path, why = fp8_weight_path(torch.device("cuda"))
    assert path == "widen" and "8.0 < 8.9" in why
    assert fp8_weight_path(torch.device("cuda"), torch.float32)[0] == "widen"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8_weight_path(torch.device("cuda"))[0] == "scaled_mm"
    assert fp8_weight_path(torch.device("cuda"), torch.float32)[0] == "widen"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_weight_path(torch.device("cuda"), torch.float32)[0] == "scaled_mm"
    monkeypatch.setenv(FP8_MATMUL_ENV, "widen")
    assert fp8_weight_path(torch.device("cuda")) == ("widen", f"{FP8_MATMUL_ENV}=widen")
    monkeypatch.setenv(FP8_MATMUL_ENV, "fast")
    with pytest.raises(ValueError, match=FP8_MATMUL_ENV):
        fp8_weight_path(torch.device("cpu"))


@pytest.fixture(scope="module")
def written(model_factory, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    source = model_factory("llama", seed=3, tie_word_embeddings=False)
    out = {}
    for name, scheme in SCHEMES.items():
        root = tmp_path_factory.mktemp(name)
        write_quantized(source, root / "q", scheme, reference=root / "ref")
        out[name] = (root / "q", root / "ref")
    return out


def _fused_reference(ref: Path, layer: int) -> dict[str, torch.Tensor]:
    t = load_file(str(ref / "model.safetensors"))
    p = f"model.layers.{layer}."
    return {
        "qkv_proj": torch.cat([t[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]),
        "o_proj": t[f"{p}self_attn.o_proj.weight"],
        "gate_up_proj": torch.cat([t[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]),
        "down_proj": t[f"{p}mlp.down_proj.weight"],
    }


@pytest.mark.parametrize("name", ["fp8-tensor", "ct-fp8-channel"])
def test_loader_keeps_the_checkpoints_fp8_bytes_and_scales(name, written, monkeypatch):
    """Fused q/k/v and gate/up: each shard's rows keep its own bytes and scale (three per-tensor
    scales become one per row); dequantized, every layer is the reference weight exactly."""
    monkeypatch.setenv(FP8_MATMUL_ENV, "scaled_mm")
    qdir, ref = written[name]
    cfg = ModelConfig.from_pretrained(qdir)
    model = load_model(cfg, torch.float32, torch.device("cpu"), "torch", 64, cpu_kernels=False)
    q = load_file(str(qdir / "model.safetensors"))
    for i, layer in enumerate(model.layers):
        expected = _fused_reference(ref, i)
        for leaf in LAYERS:
            lin = getattr(layer.self_attn if leaf in ("qkv_proj", "o_proj") else layer.mlp, leaf)
            assert isinstance(lin, Fp8Linear), (i, leaf)
            torch.testing.assert_close(lin.qweight.float() * lin.scale.T, expected[leaf], rtol=0, atol=0)
        k = q[f"model.layers.{i}.self_attn.k_proj.weight"]
        rows = layer.self_attn.qkv_proj.qweight[cfg.num_heads * cfg.head_dim :][: k.shape[0]]
        assert torch.equal(rows.view(torch.uint8), k.view(torch.uint8))
    kinds, _ = linear_report(model)
    assert kinds["qkv_proj"].path.startswith("torch._scaled_mm")
    assert kinds["lm_head"].path.startswith("F.linear")  # the head is not fp8 in the checkpoint


def test_block_scales_stay_widened(written, monkeypatch, caplog):
    monkeypatch.setenv(FP8_MATMUL_ENV, "scaled_mm")
    qdir, _ = written["fp8-block"]
    cfg = ModelConfig.from_pretrained(qdir)
    with caplog.at_level("INFO", logger="tandem.model.loader"):
        model = load_model(cfg, torch.float32, torch.device("cpu"), "torch", 64, cpu_kernels=False)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert "0 linear layers run torch._scaled_mm" in caplog.text and "(block scales)" in caplog.text


def _hf_logprobs(folder: Path, sequences: list[list[int]], fp8_inputs: bool) -> list[torch.Tensor]:
    """transformers on the dequantized reference; with `fp8_inputs`, each projection's input
    rounded per token to fp8 first (what `Fp8Linear` does before its product)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if fp8_inputs:

        def round_input(module, args):
            x = args[0]
            q, s = quantize_rows(x.reshape(-1, x.shape[-1]))
            return ((q.float() * s).reshape(x.shape),)

        for name, m in model.named_modules():
            if name.rsplit(".", 1)[-1] in (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ):
                m.register_forward_pre_hook(round_input)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0].double(), -1) for s in sequences]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [11, 12, 13], list(range(20, 60))]
# Max |logprob difference| to transformers with the same fp8 rounding of each projection's input:
# float32 sums in another order (measured 1e-6), and now and then an activation on a rounding
# boundary going the other way (one e4m3 step of one element). Without the rounding the reference
# is 0.4-0.6 away on these sharp random models (initializer_range 0.2).
LOGPROB_TOL = 1e-3


@pytest.mark.parametrize("name", ["fp8-tensor", "ct-fp8-channel"])
def test_engine_on_fp8_weights_matches_the_reference_with_fp8_activations(name, written, monkeypatch):
    """The GPU path (triton attention, plain layers) with the fp8 layers, end to end, against
    transformers on the dequantized weights with each projection's input rounded per token to
    fp8: every chosen token's logprob and greedy choice. Without that rounding the reference
    moves by far more (the check that the rounding is really there)."""
    monkeypatch.setenv(FP8_MATMUL_ENV, "scaled_mm")
    qdir, ref = written[name]
    llm = LLM(
        str(qdir), attention_backend="triton", dtype="float32", device=DEVICE, num_kv_blocks=64, **GPU_KV
    )
    model = llm.engine.core.runner.model
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * len(model.layers)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)]
    worst = {}
    for fp8_inputs in (True, False):
        worst[fp8_inputs] = 0.0
        for p, o, lp in zip(PROMPTS, outs, _hf_logprobs(ref, seqs, fp8_inputs)):
            for j, tok in enumerate(o.outputs[0].token_ids):
                row = lp[len(p) - 1 + j]
                worst[fp8_inputs] = max(
                    worst[fp8_inputs], abs(o.outputs[0].logprobs[j][tok].logprob - float(row[tok]))
                )
                if fp8_inputs:
                    assert int(row.argmax()) == tok
    assert worst[True] < LOGPROB_TOL, worst
    assert worst[False] > 100 * LOGPROB_TOL, worst


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_scaled_mm_matches_the_dequantized_product(dtype):
    assert fp8_weight_path(torch.device("cuda"))[0] == "scaled_mm", "needs compute capability >= 8.9"
    q, scale, bias = _random_fp8_layer(4096, 1024, 1, "cuda")
    lin = Fp8Linear(q, scale, bias.to(dtype))
    for rows in (1, 7, 256):
        x = torch.randn(rows, 1024, device="cuda").to(dtype)
        y = lin(x)
        qa, sa = quantize_rows(x)
        exact = (qa.float() * sa) @ (q.float() * scale[:, None]).T + bias
        torch.testing.assert_close(y.float(), exact, rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
def test_cuda_engine_takes_scaled_mm_for_an_fp8_checkpoint(written, monkeypatch):
    monkeypatch.delenv(FP8_MATMUL_ENV, raising=False)
    qdir, _ = written["ct-fp8-channel"]
    llm = LLM(str(qdir), device="cuda", dtype="bfloat16", kv_cache_memory=64 << 20)
    kinds, _ = linear_report(llm.engine.core.runner.model)
    assert kinds["down_proj"].path.startswith("torch._scaled_mm")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
