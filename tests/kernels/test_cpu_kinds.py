"""The kernels, and the layers that choose between them, as built and chosen for CPU kinds other
than this host's (`TANDEM_CPU_MARCH`, tandem/cpu.py): AVX2 without AVX-512 (AMD Zen 2/3 class;
`haswell`), AVX-512 with BF16 and VNNI but no AMX (AMD Zen 4 class; `cooperlake`, the same
kernel set, which GCC 12 knows where it does not know `znver4`) and AVX-512 with VNNI but no BF16
(Intel Ice Lake and Cascade Lake servers; `icelake-server`). Each kind runs in a subprocess:
a process's flags and its library's operators are fixed for its life. A host that cannot run a
kind's instructions skips it; on an AMX host every kind runs, so the paths of every CPU kind are tested
wherever the suite runs, oneDNN's and MKL's included (capped at the kind's instructions)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import cpu

REPO = Path(__file__).resolve().parents[2]
# What each kind's library must hold and lack: the proof that the build and the flags followed the
# target rather than the host.
KINDS = {
    "haswell": (
        {"gemv_f32", "gemm_w8_f32", "gemm_w8a8", "gemm_int4", "paged_attention"},
        {"gemv_bf16", "gemm_bf16_panels", "gemm_w8a8_panels", "gemm_int4_panels", "gemm_amx_bf16"},
    ),
    "cooperlake": (
        {"gemv_f32", "gemv_bf16", "gemm_bf16_panels", "gemm_w8a8", "gemm_w8a8_panels", "gemm_int4", "gemm_int4_panels"},
        {"gemm_w8_f32", "gemm_amx_bf16", "paged_attention_amx"},
    ),
    "icelake-server": (
        {"gemv_f32", "gemm_w8a8", "gemm_w8a8_panels", "gemm_int4", "gemm_int4_panels"},
        {"gemv_bf16", "gemm_bf16_panels", "gemm_w8_f32", "gemm_amx_bf16", "paged_attention_amx"},
    ),
}
# The kernels against their references, then whole models against transformers and the int8 layers
# through the paths this kind chooses.
TESTS = [
    "tests/kernels/test_cpu_kernels.py",
    "tests/kernels/test_int4_kernel.py",
    "tests/kernels/test_int4_panels.py",
    "tests/kernels/test_layer_ops.py",
    "tests/kernels/test_kernel_isa.py",
    "tests/kernels/test_panels.py",
    "tests/model/test_attention.py",
    "tests/model/test_parity.py",
    "tests/model/test_quant.py",
]
CHECK = """
import sys
from tandem import cpu, kernels
assert kernels.load(), "the library did not build"
have, lack = set(sys.argv[1].split(",")), set(sys.argv[2].split(","))
missing = [op for op in sorted(have) if not kernels.has(op)]
extra = [op for op in sorted(lack) if kernels.has(op)]
assert not missing and not extra, (missing, extra)
assert not {"amx_tile", "amx_bf16"} & cpu.cpu_flags()
import os
caps = cpu.library_isa_caps(cpu.cpu_flags())
assert caps and all(os.environ.get(var) == isa for var, isa in caps.items()), caps
"""


@pytest.mark.slow
@pytest.mark.parametrize("march", list(KINDS))
def test_kernels_and_layers_as_built_for(march: str) -> None:
    try:
        macros = cpu.march_macros(march)
    except ValueError as exc:
        pytest.skip(str(exc))
    needs = {flag for macro, flag in cpu.MACRO_FLAGS.items() if macro in macros}
    if not needs <= cpu._host_flags():
        pytest.skip(f"this host cannot run {march}'s instructions: {sorted(needs - cpu._host_flags())}")
    inherited = {k: v for k, v in os.environ.items() if k not in cpu.LIBRARY_ISA}
    env = inherited | {cpu.MARCH_ENV: march}
    have, lack = KINDS[march]
    check = subprocess.run(
        [sys.executable, "-c", CHECK, ",".join(have), ",".join(lack)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *TESTS],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert tests.returncode == 0, tests.stdout[-4000:]


def test_a_target_drops_the_flags_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TANDEM_CPU_MARCH the flags are the host's less those the target's compiler macros
    lack, and the kernels compile for the target."""
    from tandem import kernels

    monkeypatch.setattr(cpu, "_host_flags", lambda: frozenset({"avx2", "fma", "avx512f", "amx_tile", "sse4_2"}))
    monkeypatch.setattr(cpu, "march_macros", lambda march: frozenset({"__AVX2__", "__FMA__"}))
    monkeypatch.setenv(cpu.MARCH_ENV, "haswell")
    # Restored after the test: the libraries of this process must not be capped by it.
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512")  # one the user set is kept
    cpu.cpu_flags.cache_clear()
    try:
        assert cpu.cpu_flags() == {"avx2", "fma", "sse4_2"}  # flags no macro stands for are kept
        assert kernels.cflags()[0] == "-march=haswell"
        assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX512"
        monkeypatch.setenv(cpu.MARCH_ENV, "native")
        cpu.cpu_flags.cache_clear()
        assert "amx_tile" in cpu.cpu_flags() and kernels.cflags()[0] == "-march=native"
    finally:
        cpu.cpu_flags.cache_clear()


def test_the_libraries_are_capped_at_each_kinds_instructions() -> None:
    """oneDNN and MKL run the products a CPU of the target's kind would: no AMX tiles for a Zen 4
    class target, AVX2 for a Zen 2/3 class one."""
    sapphire_rapids = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"})
    zen4 = sapphire_rapids - {"amx_bf16", "amx_tile"}
    assert cpu.library_isa_caps(sapphire_rapids)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX"
    assert cpu.library_isa_caps(zen4) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    assert cpu.library_isa_caps(frozenset({"avx2", "fma"})) == {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cpu.library_isa_caps(frozenset({"sse4_2"})) == {}


def test_an_unknown_target_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu.shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    with pytest.raises(ValueError, match=cpu.MARCH_ENV):
        cpu.march_macros("no-such-cpu")
