"""What the host CPU can do, for choosing kernels (Linux /proc/cpuinfo; empty elsewhere).

`TANDEM_CPU_MARCH` (a GCC `-march` name, e.g. `haswell` or `znver4`) makes Tandem act as on that
CPU kind: the kernels are compiled for it instead of `-march=native` (tandem/kernels), and
`cpu_flags()` drops the host's instruction-set flags that the target lacks, so every kernel choice
made from the flags is the target's. It lets an AMX host test the AVX2 and AVX-512-without-AMX
paths; the target must be one the host can run (a subset of its instructions). The libraries'
products follow it too: oneDNN and MKL are capped at the target's instruction set
(`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`, unless already set), which they read before their
first product, and Tandem reads its flags before it loads a model."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

MARCH_ENV = "TANDEM_CPU_MARCH"

# The compiler's instruction-set macros and the /proc/cpuinfo flag each stands for: the flags the
# kernels and their callers choose by. Under TANDEM_CPU_MARCH a flag whose macro the target does
# not define is dropped.
MACRO_FLAGS = {
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512VL__": "avx512vl",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512VBMI__": "avx512vbmi",
    "__AVX512FP16__": "avx512_fp16",
    "__AVXVNNI__": "avx_vnni",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8",
}


# The instruction-set caps oneDNN and MKL take for a target's flags, best first: a target without
# AMX runs oneDNN's AVX-512 BF16 kernels, as an AMD EPYC of that kind does.
ONEDNN_ISA = (
    ("amx_bf16", "AVX512_CORE_AMX"),
    ("avx512_bf16", "AVX512_CORE_BF16"),
    ("avx512_vnni", "AVX512_CORE_VNNI"),
    ("avx512f", "AVX512_CORE"),
    ("avx_vnni", "AVX2_VNNI"),
    ("avx2", "AVX2"),
)
MKL_ISA = (("avx512f", "AVX512"), ("avx2", "AVX2"))
# The environment variable each library reads its cap from.
LIBRARY_ISA = {"ONEDNN_MAX_CPU_ISA": ONEDNN_ISA, "MKL_ENABLE_INSTRUCTIONS": MKL_ISA}


def library_isa_caps(flags: frozenset[str]) -> dict[str, str]:
    """The environment that caps oneDNN and MKL at the instruction set of a CPU with `flags`."""
    caps = {}
    for var, table in LIBRARY_ISA.items():
        isa = next((isa for flag, isa in table if flag in flags), None)
        if isa is not None:
            caps[var] = isa
    return caps


def target_march() -> str | None:
    """The `-march` target TANDEM_CPU_MARCH names, or None for the host (`native`)."""
    march = os.environ.get(MARCH_ENV, "").strip()
    return march if march and march != "native" else None


def compiler_path() -> str:
    """The C++ compiler PyTorch's builder runs ($CXX, else c++), as found on the PATH."""
    compiler = os.environ.get("CXX", "c++")
    return shutil.which(compiler) or compiler


def march_macros(march: str) -> frozenset[str]:
    """The instruction-set macros the C++ compiler defines for `-march=<march>`."""
    cmd = [compiler_path(), f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"{MARCH_ENV}={march!r}: cannot ask the compiler ({exc})") from exc
    if proc.returncode != 0:
        raise ValueError(f"{MARCH_ENV}={march!r}: not a -march the compiler knows ({proc.stderr.strip()[:200]})")
    return frozenset(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define __"))


def _host_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@cache
def cpu_flags() -> frozenset[str]:
    flags = _host_flags()
    march = target_march()
    if march is None:
        return flags
    macros = march_macros(march)
    lacking = {flag for macro, flag in MACRO_FLAGS.items() if macro not in macros}
    target = flags - lacking
    caps = {var: isa for var, isa in library_isa_caps(target).items() if var not in os.environ}
    os.environ.update(caps)
    logger.info(
        "%s=%s: acting as a CPU without %s%s",
        MARCH_ENV,
        march,
        ", ".join(sorted(lacking & flags)) or "nothing",
        "".join(f"; {var}={isa}" for var, isa in caps.items()),
    )
    return target


def cpu_model() -> str:
    """The CPU's model name, for benchmark reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
