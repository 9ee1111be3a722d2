"""Model weights on transparent huge pages (Linux).

A decode step streams every weight once, hundreds of megabytes in 4 KB pages: a TLB miss every
64 cache lines, walked twice over in a virtual machine (guest and host page tables), and the
hardware prefetchers stop at each 4 KB boundary. In 2 MB pages the same stream runs ~10% faster on
the 2-core Sapphire Rapids VM (benchmarks/gemm_paths.py --huge-pages: every row count from 1 to 64).

Most distributions set transparent huge pages to `madvise`: only memory asked for gets them, and
PyTorch's allocator does not ask. So large tensors are copied into private anonymous mappings
marked MADV_HUGEPAGE, aligned to 2 MB. Where the kernel says `never`, off Linux, or with
`TANDEM_HUGE_PAGES=0`, nothing moves. The KV cache stays in ordinary pages: a 32-stream decode
step reads ~75 MB of it and ran no faster in huge pages, while touching them costs start-up time
on a VM (the host backs each fresh 2 MB page on first touch, ~1 s a GB).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Moved tensors between two hand-backs of freed memory: each old copy returns to the system soon
# after its new one is made, so loading peaks at about one model, not two.
_TRIM_EVERY = 8


def huge_pages_available() -> bool:
    """True when this kernel hands out transparent huge pages to memory that asks (`always` or
    `madvise`) and `TANDEM_HUGE_PAGES=0` is not set."""
    if os.environ.get("TANDEM_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def huge_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor whose memory starts on a 2 MB boundary of a fresh mapping marked for huge pages,
    so zero-filled (by the kernel, page by page as it is first touched). The mapping lives as long
    as the tensor (the tensor holds the buffer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    # Private and anonymous: memory of this process only, like the allocator's.
    area = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(area, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + nbytes].view(dtype).view(shape)


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of a contiguous CPU tensor in huge-page memory (its bytes in the same order, so
    opaque packed layouts stay valid)."""
    out = huge_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def _movable(t: object, min_bytes: int) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_quantized
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()  # the tensor is its storage
        and t.numel() * t.element_size() >= min_bytes
    )


def move_weights_to_huge_pages(module: nn.Module, min_bytes: int = HUGE_PAGE_BYTES) -> int:
    """Moves every parameter, buffer and tensor attribute of `module` and its submodules that holds
    at least `min_bytes` into huge-page memory. A tensor shared by several owners (tied embeddings)
    moves once and stays shared; one already moved is not movable again (its storage is the larger
    mapping). Where the system refuses a mapping, the rest stays where it is. Returns the bytes moved."""
    moved: dict[int, torch.Tensor] = {}
    refused = False

    def move(t: torch.Tensor) -> torch.Tensor:
        nonlocal refused
        key = t.data_ptr()
        if key not in moved and not refused:
            try:
                moved[key] = to_huge_pages(t)
            except (OSError, ValueError):  # no mapping granted (a memory limit): ordinary pages
                refused = True
            else:
                if len(moved) % _TRIM_EVERY == 0:
                    release_freed_memory()
        return moved.get(key, t)

    for sub in module.modules():
        attrs = vars(sub)
        for name in [n for n, v in attrs.items() if n not in ("_parameters", "_buffers") and _movable(v, min_bytes)]:
            setattr(sub, name, move(attrs[name]))
        for param in sub._parameters.values():
            if param is not None and _movable(param, min_bytes):
                param.data = move(param.data)
        for name in [n for n, b in sub._buffers.items() if b is not None and _movable(b, min_bytes)]:
            sub._buffers[name] = move(sub._buffers[name])  # type: ignore[arg-type]
    release_freed_memory()
    return sum(t.numel() * t.element_size() for t in moved.values())


def release_freed_memory() -> None:
    """Hands memory the C allocator holds free back to the system (glibc's malloc_trim; nothing
    elsewhere). The weights' old copies are freed in the middle of the heap, where glibc keeps them
    resident: without this a moved model counts its weights twice in the process's memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
