"""Tandem's compiled CPU kernels (`cpu_ops.cpp`: products and attention; `int4_ops.cpp`: 4-bit
weight products; `amx_ops.cpp`: AMX tile products for decode-sized batches; `amx_attention.cpp`:
attention on AMX tiles; `layer_ops.cpp`: a decoder layer's per-token glue), one library built from
source on first use.

The build needs only what a clean install brings: a C++ compiler on the PATH, PyTorch's headers and
`ninja` (a dependency). It compiles for the host CPU (`-march=native`; `TANDEM_CPU_MARCH` names another
kind, tandem/cpu.py) into PyTorch's extension
cache (`TORCH_EXTENSIONS_DIR`, by default under ~/.cache), in a folder named by everything the build
depends on (`build_inputs()`: sources, flags, compiler, PyTorch and its headers' location, CPU
features), so virtualenvs and machines sharing the cache keep a build each; later runs load the
cached library. A first build says on stderr what it is doing and how far it got. If the build
fails, or `TANDEM_CPU_KERNELS=0` is set, `load()` returns False and every caller keeps its
pure-torch path, which the tests also cover. Each operator exists only where the host CPU has its
instructions (`has(name)`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import TextIO

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_ops.cpp", "layer_ops.cpp", "int4_ops.cpp", "amx_ops.cpp", "amx_attention.cpp", "panel_ops.cpp"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("exp_approx.h", "kernel_util.h"))
ENV_SWITCH = "TANDEM_CPU_KERNELS"
# -fno-trapping-math: floating-point exceptions stay masked (as PyTorch runs), so the compiler may
# turn the clamps before an exp into vector selects; it changes no result. -mprefer-vector-width=512:
# GCC vectorizes for 256-bit registers on AVX-512 CPUs unless told; the per-token layer ops run
# 15-30% faster with 512 (Sapphire Rapids VM: SiLU-and-multiply of 512 x 4864 bf16 937 -> 798 us,
# RMSNorm 744 -> 599 us). No effect where the CPU has no 512-bit vectors.
CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math", "-mprefer-vector-width=512")
LDFLAGS = ("-fopenmp",)
# A first build's progress on stderr: the build folder is looked at this often for finished
# objects, and a line is written at least this often while nothing new has finished.
PROGRESS_POLL_S = 1.0
PROGRESS_HEARTBEAT_S = 20.0


def cflags() -> tuple[str, ...]:
    """The compiler flags: CFLAGS for the host CPU, or for the target `TANDEM_CPU_MARCH` names
    (tandem/cpu.py)."""
    from tandem import cpu

    return (f"-march={cpu.target_march() or 'native'}", *CFLAGS)


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class BuildInputs:
    """What the compiled library depends on; its digest names the build (folder and library)."""

    # (file name, sha256) of each source and header.
    sources: tuple[tuple[str, str], ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    # The compiler PyTorch's builder runs ($CXX, else c++): its path and `--version` line.
    compiler: str
    # torch.__version__ and the commit it was built from.
    torch_version: str
    # libtorch's C++ ABI: a library built against the other one does not link.
    cxx11_abi: bool
    # PyTorch's and Python's header folders: PyTorch writes them into the build commands, so two
    # virtualenvs sharing one build folder would each see the other's commands as changed and
    # rebuild everything.
    include_paths: tuple[str, ...]
    # -march=native compiles for these: a cache shared between machines must not hand one's build
    # to another.
    cpu_features: tuple[str, ...]

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compiler_identity() -> str:
    from tandem import cpu

    path = cpu.compiler_path()
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
        version = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else f"exit {proc.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        # The build will fail the same way and the pure-torch path will be used; the key only
        # needs to be stable.
        version = f"unavailable: {type(exc).__name__}"
    return f"{path}: {version}"


def build_inputs(sources: Sequence[Path] = SOURCES + HEADERS) -> BuildInputs:
    """The build's inputs on this machine, in this environment (no compiling)."""
    import torch
    from torch.utils.cpp_extension import include_paths

    from tandem import cpu

    return BuildInputs(
        sources=tuple((src.name, hashlib.sha256(src.read_bytes()).hexdigest()) for src in sources),
        cflags=cflags(),
        ldflags=LDFLAGS,
        compiler=_compiler_identity(),
        torch_version=f"{torch.__version__} {torch.version.git_version}",
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        include_paths=(*include_paths(), sysconfig.get_paths()["include"]),
        cpu_features=tuple(sorted(cpu.cpu_flags())),
    )


def library_name(inputs: BuildInputs | None = None) -> str:
    """The build's name (its folder's and library's), one per set of build inputs."""
    return f"tandem_cpu_ops_{(inputs or build_inputs()).digest()}"


def build_directory(name: str) -> Path:
    """Where the build named `name` lives: under `TORCH_EXTENSIONS_DIR`, else PyTorch's default
    extensions folder for this Python."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_cpu"
        root = os.path.join(get_default_build_root(), tag)
    return Path(root) / name


def progress_line(done: Sequence[str], total: int, elapsed: float) -> str:
    if not done:
        return f"tandem: still compiling the CPU kernels, {elapsed:.0f} s"
    return f"tandem: {len(done)} of {total} sources compiled ({', '.join(done)}), {elapsed:.0f} s"


class BuildProgress:
    """Around the build: when the library is not built yet, say so on `stream`, then report each
    source whose object file appears (ninja runs silently inside PyTorch's builder) with the time
    so far, and the total at the end. A cached library loads without a word."""

    def __init__(self, build_dir: Path, name: str, sources: Sequence[Path], stream: TextIO) -> None:
        self.build_dir = build_dir
        self.library = build_dir / f"{name}.so"
        self.sources = tuple(sources)
        self.stream = stream
        self.active = False
        self.start = 0.0
        self.reported: tuple[str, ...] = ()
        self.last_line = 0.0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> BuildProgress:
        self.active = not self.library.exists()
        if not self.active:
            return self
        self.start = self.last_line = time.monotonic()
        self._say(
            f"tandem: compiling the CPU kernels for this machine into {self.build_dir} (once per machine, "
            "compiler and PyTorch install; from under a minute to a few minutes, depending on the CPU)"
        )
        self.thread = threading.Thread(target=self._watch, name="tandem-kernel-build", daemon=True)
        self.thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.active:
            return
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        self._poll(time.monotonic(), heartbeat=False)
        elapsed = time.monotonic() - self.start
        if self.library.exists():
            self._say(f"tandem: CPU kernels built in {elapsed:.0f} s, cached in {self.build_dir}")
        else:
            self._say(f"tandem: the CPU kernel build stopped after {elapsed:.0f} s")

    def _done(self) -> tuple[str, ...]:
        return tuple(src.name for src in self.sources if (self.build_dir / f"{src.stem}.o").exists())

    def _poll(self, now: float, heartbeat: bool) -> None:
        done = self._done()
        if done != self.reported or (heartbeat and now - self.last_line >= PROGRESS_HEARTBEAT_S):
            self.reported = done
            self.last_line = now
            self._say(progress_line(done, len(self.sources), now - self.start))

    def _watch(self) -> None:
        while not self.stop.wait(PROGRESS_POLL_S):
            self._poll(time.monotonic(), heartbeat=True)

    def _say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


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
        name = library_name()
        build_dir = build_directory(name)
        build_dir.mkdir(parents=True, exist_ok=True)
        with BuildProgress(build_dir, name, SOURCES, sys.stderr):
            load(
                name=name,
                sources=[str(src) for src in SOURCES],
                extra_cflags=list(cflags()),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(build_dir),
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
