"""Smoke test: `benchmarks/throughput.py --quick` runs end to end and writes a complete result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "throughput.py"


def test_throughput_quick(tmp_path: Path) -> None:
    result_json = tmp_path / "out" / "throughput.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--result-json",
            str(result_json),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio tandem / transformers" in proc.stdout

    result = json.loads(result_json.read_text())
    for key in (
        "command",
        "command_line",
        "torch_num_threads",
        "model",
        "workload",
        "tandem",
        "hf",
        "ratio_tandem_over_hf",
        "greedy_agreement",
    ):
        assert key in result, key
    assert result["quick"] is True
    assert result["torch_num_threads"] >= 1
    assert result["model"]["num_parameters"] > 0
    assert result["model"]["built_random_weights"] is True

    work = result["workload"]
    assert work["num_prompts"] == 4
    assert len(work["input_lens"]) == len(work["output_lens"]) == 4
    assert work["output_tokens"] == sum(work["output_lens"])

    for system in ("tandem", "hf"):
        figures = result[system]
        assert figures["wall_time_s"] > 0
        assert figures["output_tokens"] == work["output_tokens"]
        assert figures["output_tokens_produced"] == work["output_tokens"]
        assert figures["output_tokens_per_s"] > 0
        assert figures["total_tokens_per_s"] > figures["output_tokens_per_s"]
    assert result["hf"]["raw_generated_tokens"] >= work["output_tokens"]
    assert result["ratio_tandem_over_hf"]["output_tokens_per_s"] > 0

    agreement = result["greedy_agreement"]
    assert 0.0 <= agreement["exact_match_fraction"] <= 1.0
    assert agreement["num_prompts"] == 4
