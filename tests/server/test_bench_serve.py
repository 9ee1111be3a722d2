"""`tandem bench serve` end to end against `tandem serve` on the tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_utils import FAST_ARGS, RemoteServer

SUMMARY_KEYS = {
    "duration_s",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "goodput",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "server_metrics",
    "errors",
}
STAT_KEYS = {"mean", "std", "median", "p90", "p99"}


@pytest.mark.slow
def test_bench_serve_against_tandem_serve(llama_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "result.json"
    plots = tmp_path / "plots"
    with RemoteServer(llama_dir, *FAST_ARGS) as server:
        proc = subprocess.run(
            [
                sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve",
                "--base-url", server.url, "--model", str(llama_dir), "--tokenizer", str(tokenizer_dir),
                "--num-prompts", "6", "--dataset", "random", "--input-len", "32", "--output-len", "8",
                "--ignore-eos", "--max-concurrency", "3", "--goodput", "ttft:60000", "tpot:60000",
                "--result-json", str(out), "--plot", str(plots), "--disable-tqdm",
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms)" in proc.stdout
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 1
    run = result["runs"][0]
    assert set(run) >= SUMMARY_KEYS and set(result) >= SUMMARY_KEYS
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(run[key]) == STAT_KEYS
        assert run[key]["median"] > 0
    assert run["completed"] == 6 and run["failed"] == 0 and run["errors"] == []
    assert run["total_output_tokens"] == 6 * 8  # ignore_eos: every request runs to max_tokens
    assert run["total_input_tokens"] == 6 * 32
    assert run["max_concurrency"] == 3 and run["request_rate"] is None
    assert run["goodput"]["good_requests"] == 6
    assert run["e2el_ms"]["p99"] >= run["ttft_ms"]["p99"] > 0
    assert len(run["ttfts_s"]) == 6 and len(run["itls_s"]) >= 6
    sm = run["server_metrics"]
    assert sm["generation_tokens"] == 6 * 8 and sm["prompt_tokens"] >= 6 * 32 - 6
    assert "prefix_cache_queries" in sm and "preemptions" in sm
    assert {p.name for p in plots.glob("*.png")} == {"ttft_cdf.png", "itl_cdf.png"}
