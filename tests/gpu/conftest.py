"""The GPU path's tests. Without a GPU its Triton kernels run on CPU tensors under the Triton
interpreter (set before Triton is first imported); tests that need a real GPU are marked `gpu`
and skip without one."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(skip)
