"""The start-up report names each few-row kernel with the instructions it runs on this machine
kind (issue 46: kernel choice by CPU feature, named in the log)."""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.cpu import cpu_flags
from tandem.kernels.isa import kernel_instructions
from tandem.model.linear import PackedLinear, kernel_max_rows
from tandem.model.linear_report import few_row_paths, linear_path

SAPPHIRE_RAPIDS = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}
ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
ZEN2 = {"avx2", "fma"}


def test_each_machine_kind_names_its_instructions():
    assert kernel_instructions("gemm_amx_bf16", SAPPHIRE_RAPIDS) == "AMX-BF16 tiles"
    assert kernel_instructions("gemm_amx_w8a8", SAPPHIRE_RAPIDS) == "AMX-INT8 tiles"
    assert kernel_instructions("gemv_bf16", ZEN4) == "AVX512-BF16 vdpbf16ps"
    assert kernel_instructions("gemm_w8a8", ZEN4) == "AVX512-VNNI vpdpbusd"
    assert kernel_instructions("gemm_int4", ZEN4) == "AVX512-VNNI vpdpbusd"
    assert kernel_instructions("gemv_f32", ZEN4) == "AVX-512 FMA"
    assert kernel_instructions("gemv_f32", ZEN2) == "AVX2 FMA"
    assert kernel_instructions("gemm_int4", ZEN2) == "AVX2 FMA"
    assert kernel_instructions("gemm_w8_f32", ZEN2).startswith("AVX2 FMA")
    assert kernel_instructions("gemm_w8a8", ZEN2).startswith("AVX2 vpmaddubsw")
    with pytest.raises(ValueError, match="unknown kernel"):
        kernel_instructions("gemm_nothing", ZEN4)


def test_each_machine_kind_gets_its_few_row_limits():
    """bfloat16 few-row kernel: to 4 rows beside oneDNN's AMX product, to its 16 where oneDNN has
    only AVX512-BF16 (benchmarks/gemm_paths.py --few-rows, docs/benchmarks-kernels.md)."""
    assert kernel_max_rows(torch.bfloat16, SAPPHIRE_RAPIDS) == 4
    assert kernel_max_rows(torch.bfloat16, ZEN4) == 16
    assert kernel_max_rows(torch.float32, ZEN4) == 16
    assert kernel_max_rows(torch.float32, ZEN2) == 8


@pytest.mark.skipif(not kernels.load(), reason="Tandem's CPU kernels did not build here")
def test_the_report_names_the_kernel_this_cpu_runs():
    """A float32 layer's few-row paths as the report gives them: MKL's sgemv for one or two rows
    on AVX-512 CPUs, then gemv_f32 named with this CPU's instructions."""
    layer = PackedLinear(torch.randn(64, 32), None)
    path, _ = linear_path(layer)
    flags = cpu_flags()
    if layer.plain is None:
        pytest.skip("no few-row path for float32 on this CPU")
    assert few_row_paths(torch.float32, layer.plain_max_rows) in path
    if kernels.has("gemv_f32"):
        isa = "AVX-512 FMA" if "avx512f" in flags else "AVX2 FMA"
        assert f"gemv_f32 ({isa}) for <= {layer.plain_max_rows} rows" in path
    if "avx512f" in flags:
        assert "MKL sgemv for <= 2 rows" in path
