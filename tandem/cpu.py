"""What the host CPU can do, for choosing kernels (Linux /proc/cpuinfo; empty elsewhere).

`TANDEM_CPU_MARCH` (a GCC `-march` name, e.g. `haswell` or `znver4`) makes Tandem act as on that
CPU kind: the kernels are compiled for it instead of `-march=native` (tandem/kernels), and
`cpu_flags()` drops the host's instruction-set flags that the target lacks, so every kernel choice
made from the flags is the target's. It lets an AMX host test the AVX2 and AVX-512-without-AMX
paths; the target must be one the host can run (a subset of its instructions)."""

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
    logger.info("%s=%s: acting as a CPU without %s", MARCH_ENV, march, ", ".join(sorted(lacking & flags)) or "nothing")
    return flags - lacking


def cpu_model() -> str:
    """The CPU's model name, for benchmark reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
