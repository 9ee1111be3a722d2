"""Layering that imports can break: the core and the API process's request path never import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def modules_after_import(*names: str) -> set[str]:
    code = "import sys\n" + "".join(f"import {n}\n" for n in names) + "print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "names",
    [
        # The scheduler, KV pool, prefix cache and policies: pure Python.
        ("tandem.core.scheduler", "tandem.core.kv_cache_manager", "tandem.core.prefix_cache", "tandem.core.policy"),
        # The speculation planner and its adaptive controller: pure Python too.
        ("tandem.spec.planner",),
        # The API process: HTTP, validation, tokenization, the engine client and its messages.
        (
            "tandem.entrypoints.openai.api_server",
            "tandem.engine.core_client",
            "tandem.engine.messages",
            "tandem.engine.processor",
        ),
    ],
)
def test_no_torch_on_the_request_path(names):
    loaded = modules_after_import(*names)
    assert "torch" not in loaded
    assert "tandem.engine.core" not in loaded  # the wire types are data, not the engine


def test_the_drafter_does_not_import_the_runner():
    """The runner uses the drafter, not the other way round: the drafter sees the runner through
    `DraftHost`, and both build batches with `tandem.worker.batch`."""
    assert "tandem.worker.model_runner" not in modules_after_import("tandem.worker.drafter")
