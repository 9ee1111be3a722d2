"""Which instructions each of Tandem's product kernels was built with on this CPU, for the start-up
report. The kernels compile with -march=native and each registers only where its instructions
exist (tandem/kernels/*.cpp), so the CPU's flags say which form of a kernel runs."""

from __future__ import annotations

from collections.abc import Set

from tandem.cpu import cpu_flags


def kernel_instructions(kernel: str, flags: Set[str] | None = None) -> str:
    """The instruction set `kernel` multiplies with on a CPU with `flags` (this one's when None):
    what the start-up log names beside each few-row path, so a run's log tells which kernel a
    machine kind got (AMX, AVX-512 BF16/VNNI, AVX2)."""
    f = cpu_flags() if flags is None else flags
    avx512 = "avx512f" in f
    vnni512 = "avx512_vnni" in f and "avx512bw" in f
    if kernel in ("gemm_amx_bf16", "gemm_amx_int4"):
        return "AMX-BF16 tiles"
    if kernel == "gemm_amx_w8a8":
        return "AMX-INT8 tiles"
    if kernel in ("gemv_bf16", "gemm_bf16_panels"):
        return "AVX512-BF16 vdpbf16ps"
    if kernel in ("gemm_w8a8_panels", "gemm_int4_panels"):
        return "AVX512-VNNI vpdpbusd"
    if kernel == "gemm_w8a8":
        return "AVX512-VNNI vpdpbusd" if vnni512 else "AVX2 vpmaddubsw, signs moved onto the weights"
    if kernel == "gemv_f32":
        return "AVX-512 FMA" if avx512 else "AVX2 FMA"
    if kernel == "gemm_w8_f32":
        return "AVX2 FMA, int8 widened in registers"
    if kernel == "gemm_int4":
        return "AVX512-VNNI vpdpbusd" if vnni512 else "AVX2 FMA"
    raise ValueError(f"unknown kernel {kernel!r}")
