"""The server's tests: every module here but the in-process ones starts `tandem serve` as a
subprocess (marked `server`, so `-m "not server"` leaves them out)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
# Pieces of the HTTP layer tested in-process: no subprocess.
IN_PROCESS = {
    "test_admission.py",
    "test_server_units.py",
    "test_tool_parsers.py",
    "test_tool_choice.py",
    "test_tool_stream.py",
    "test_admin_routes.py",
    "test_request_cost_units.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Called with the whole session's items, whichever folder's conftest it is: mark only ours.
    for item in items:
        if item.path.parent == HERE and item.path.name not in IN_PROCESS:
            item.add_marker(pytest.mark.server)
