"""Smoke test: `benchmarks/kv_transfer.py --quick` runs end to end, checks what arrived, and writes
its result file (with the reason for a candidate it could not run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Spawns receiver processes that import torch: about 10 s on 2 cores.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_kv_transfer_quick(tmp_path: Path) -> None:
    out = tmp_path / "kv_transfer.json"
    # The checkout's tandem, whichever one is installed.
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    )
    # A --mooncake-path with nothing in it: that candidate must be reported as skipped, not crash the run.
    argv = ["--quick", "--candidates", "zmq-ipc,shm,mooncake-tcp", "--mooncake-path", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "benchmarks/kv_transfer.py", *argv, "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "copy only" in proc.stdout

    result = json.loads(out.read_text())
    assert [c["tokens"] for c in result["cases"]][:4] == [16, 128, 1024, 4096]
    assert result["cases"][-1]["nbytes"] == 64 << 20
    # The default model: 8 layers x K,V x 16 tokens x 1 kv head x 64 dims x 2 bytes per block.
    assert result["cases"][0]["nbytes"] == 8 * 2 * 16 * 1 * 64 * 2
    for name in ("zmq-ipc", "shm"):
        candidate = result["candidates"][name]
        assert candidate["status"] == "ok", candidate
        assert len(candidate["results"]) == len(result["cases"])
        for row in candidate["results"]:
            assert row["verified"], (name, row)
            assert row["one_way_median_us"] > 0 and row["gb_per_s"] > 0
    mooncake = result["candidates"]["mooncake-tcp"]
    if mooncake["status"] != "ok":  # it may be installed where this runs
        assert mooncake["status"] == "skipped" and mooncake["reason"]
