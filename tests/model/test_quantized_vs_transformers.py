"""Tandem's compressed-tensors and block-FP8 checkpoints read by transformers (with the
compressed-tensors library; accelerate for FP8, which it dequantizes on a CPU): the layouts the
writers produce are the published ones, and Tandem reads the same weights.

(transformers reads AWQ and GPTQ only with gptqmodel / optimum installed, which pull in compiled
GPU packages; those are not test dependencies. It reads FP8 blocks only where they divide the
weight, and per-tensor `weight_scale` fp8 checkpoints not at all.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.checkpoints.quantize import Scheme, quantize_tensor, write_quantized
from tandem.config import ModelConfig
from tandem.model.int4_formats import read_compressed_tensors
from tandem.model.loader import load_model

pytest.importorskip("compressed_tensors")


def _projections(model) -> dict[str, torch.Tensor]:
    """transformers' decompressed projection weights as float ([out, in]), fused as Tandem fuses."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        def w(lin):
            scale = getattr(lin, "weight_scale", None)
            if lin.weight.dtype == torch.float8_e4m3fn:  # kept compressed: weight times scale
                return lin.weight.float() * scale.float()
            return lin.weight.float()

        a, m = layer.self_attn, layer.mlp
        out[f"{i}.qkv_proj"] = torch.cat([w(a.q_proj), w(a.k_proj), w(a.v_proj)])
        out[f"{i}.o_proj"] = w(a.o_proj)
        out[f"{i}.gate_up_proj"] = torch.cat([w(m.gate_proj), w(m.up_proj)])
        out[f"{i}.down_proj"] = w(m.down_proj)
    return out


# float32 scales: the library dequantizes in the scales' dtype, so float16 ones would round its result.
SCHEMES = [Scheme("ct-int4", 32, sym=True, scale_dtype=torch.float32), Scheme("ct-fp8", fp8_block=None),
           Scheme("fp8", fp8_block=(32, 32))]


@pytest.mark.parametrize("scheme", SCHEMES, ids=["ct-int4-sym", "ct-fp8-channel", "fp8-block"])
def test_transformers_and_tandem_read_the_same_weights(scheme, model_factory, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src: Path = model_factory("llama", seed=5)
    qdir = write_quantized(src, tmp_path / "q", scheme, reference=tmp_path / "ref")
    extra = {}
    if scheme.method == "fp8":
        pytest.importorskip("accelerate")
    else:
        extra["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    hf = _projections(AutoModelForCausalLM.from_pretrained(str(qdir), dtype=torch.float32, **extra))
    ref = _projections(AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32))
    ours = load_model(ModelConfig.from_pretrained(qdir), torch.float32, torch.device("cpu"), "torch", 64)
    for i, layer in enumerate(ours.layers):
        for name, lin in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            key = f"{i}.{name}"
            torch.testing.assert_close(hf[key], ref[key], rtol=0, atol=0)  # the writer's own dequantization
            got = lin(torch.eye(hf[key].shape[1])).T  # Tandem's weight (dequantize-then-GEMM path)
            torch.testing.assert_close(got, hf[key], rtol=1e-6, atol=1e-6)


def test_asymmetric_zero_points_unpack_with_the_library():
    """Asymmetric pack-quantized zero points are packed along the output dimension; the library's
    own unpacker and Tandem's reader agree (transformers itself cannot load them yet)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    w = torch.randn(24, 96)
    t, deq = quantize_tensor("p", w, Scheme("ct-int4", 32))
    zp = unpack_from_int32(t["p.weight_zero_point"], 4, torch.Size((24, 3)), packed_dim=0)
    q = unpack_from_int32(t["p.weight_packed"], 4, torch.Size((24, 96)))
    s = t["p.weight_scale"].float()
    lib = ((q.float().view(24, 3, 32) - zp.float()[..., None]) * s[..., None]).view(24, 96)
    torch.testing.assert_close(lib, deq, rtol=0, atol=0)
    qq, ss, zz, _ = read_compressed_tensors("p", t["p.weight_packed"], t["p.weight_scale"], t["p.weight_zero_point"],
                                         t["p.weight_shape"], None)
    ours = ((qq.float().view(24, 3, 32) - zz[..., None]) * ss[..., None]).view(24, 96)
    torch.testing.assert_close(ours, lib, rtol=0, atol=0)
