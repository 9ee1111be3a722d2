"""Tandem's C++ CPU kernels against their pure-PyTorch paths: everything here builds or calls them
(marked `kernels`)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Called with the whole session's items, whichever folder's conftest it is: mark only ours.
    for item in items:
        if item.path.parent == HERE:
            item.add_marker(pytest.mark.kernels)
