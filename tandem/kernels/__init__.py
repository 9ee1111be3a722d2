"""Tandem's compiled CPU kernels (`cpu_ops.cpp`: products and attention; `int4_ops.cpp`: 4-bit
weight products; `amx_ops.cpp`: AMX tile products for decode-sized batches; `amx_attention.cpp`:
attention on AMX tiles; `layer_ops.cpp`: a decoder layer's per-token glue), one library built from
source on first use.

The build needs only what a clean install brings: a C++ compiler on the PATH, PyTorch's headers and
`ninja` (a dependency). It compiles for the host CPU (`-march=native`) into PyTorch's extension
cache (`TORCH_EXTENSIONS_DIR`, by default under ~/.cache), once per source version; later runs load
the cached library. If the build fails, or `TANDEM_CPU_KERNELS=0` is set, `load()` returns False and
every caller keeps its pure-torch path, which the tests also cover. Each operator exists only
where the host CPU has its instructions (`has(name)`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_ops.cpp", "layer_ops.cpp", "int4_ops.cpp", "amx_ops.cpp", "amx_attention.cpp"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("exp_approx.h", "kernel_util.h"))
ENV_SWITCH = "TANDEM_CPU_KERNELS"
# -fno-trapping-math: floating-point exceptions stay masked (as PyTorch runs), so the compiler may
# turn the clamps before an exp into vector selects; it changes no result. -mprefer-vector-width=512:
# GCC vectorizes for 256-bit registers on AVX-512 CPUs unless told; the per-token layer ops run
# 15-30% faster with 512 (Sapphire Rapids VM: SiLU-and-multiply of 512 x 4864 bf16 937 -> 798 us,
# RMSNorm 744 -> 599 us). No effect where the CPU has no 512-bit vectors.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-mprefer-vector-width=512")


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def library_name() -> str:
    """The build's name, one per CPU feature set and source: it is compiled with -march=native, so
    a cache directory shared between different CPUs must not hand one machine's build to another;
    and checkouts with different sources sharing a cache would otherwise rebuild over each other's
    library (one process can load the other's while it is being replaced)."""
    from tandem.cpu import cpu_flags

    key = " ".join([*sorted(cpu_flags()), *CFLAGS]).encode() + b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    digest = hashlib.sha1(key).hexdigest()[:10]
    return f"tandem_cpu_ops_{digest}"


def _ninja_on_path() -> None:
    """PyTorch's builder runs `ninja` from PATH; a virtualenv used without activation lacks it."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@cache
def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()

        load(
            name=library_name(),
            sources=[str(src) for src in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        return True
    except Exception as exc:  # any build or load failure means "use the torch path"
        logger.warning("Tandem CPU kernels unavailable, using the pure-torch path: %s", exc)
        return False


def load() -> bool:
    """True when the library is loaded; builds it the first time it is asked."""
    return enabled_by_env() and _build()


def has(op: str) -> bool:
    """True when `torch.ops.tandem.<op>` exists on this host (and kernels are enabled)."""
    if not load():
        return False
    import torch

    return hasattr(torch.ops.tandem, op)
