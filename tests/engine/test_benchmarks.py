"""Smoke tests: benchmark scripts run end to end (their quick modes) and write complete result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each runs a benchmark script end to end in a subprocess: tens of seconds.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / name), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_throughput_quick(tmp_path: Path) -> None:
    result_json = tmp_path / "out" / "throughput.json"
    args = ["--quick", "--cache-dir", str(tmp_path / "cache"), "--result-json", str(result_json)]
    proc = run_script("throughput.py", *args, timeout=180)
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


def test_prefix_cache_quick(tmp_path: Path) -> None:
    result_json = tmp_path / "out" / "prefix_cache.json"
    args = ["--quick", "--cache-dir", str(tmp_path / "cache"), "--result-json", str(result_json)]
    proc = run_script("prefix_cache.py", *args, timeout=180)
    assert "ratio on / off" in proc.stdout

    result = json.loads(result_json.read_text())
    for key in (
        "command",
        "command_line",
        "torch_num_threads",
        "model",
        "workload",
        "caching_off",
        "caching_on",
        "ratio_on_over_off",
        "greedy_agreement",
    ):
        assert key in result, key
    assert result["quick"] is True
    assert result["model"]["built_random_weights"] is True

    work = result["workload"]
    n = work["num_requests"]
    assert n == 8
    assert len(work["input_lens"]) == n
    assert all(length > work["prefix_len"] for length in work["input_lens"])
    assert work["prompt_tokens"] == sum(work["input_lens"])
    assert work["output_tokens"] == n * work["output_len"]
    assert work["warm_prefix"] is False
    assert 0 < work["ideal_prefix_hit_tokens"] < work["prompt_tokens"]

    for mode in ("caching_off", "caching_on"):
        figures = result[mode]
        assert figures["enable_prefix_caching"] is (mode == "caching_on")
        assert figures["wall_time_s"] > 0
        assert figures["output_tokens"] == figures["output_tokens_produced"] == work["output_tokens"]
        assert figures["output_tokens_per_s"] > 0
        assert figures["total_tokens_per_s"] > figures["output_tokens_per_s"]
        assert figures["prefix_query_tokens"] == work["prompt_tokens"]
        ttft = figures["ttft_s"]
        assert len(figures["ttft_per_request_s"]) == n
        assert 0 < ttft["min"] <= ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= ttft["max"]
        assert ttft["min"] <= ttft["mean"] <= ttft["max"]
        assert len(figures["num_cached_tokens_per_request"]) == n
    off, on = result["caching_off"], result["caching_on"]
    assert off["prefix_hit_tokens"] == 0 and off["prefix_hit_rate"] == 0
    assert 0 < on["prefix_hit_tokens"] <= work["ideal_prefix_hit_tokens"]
    assert on["prefix_hit_rate"] == on["prefix_hit_tokens"] / work["prompt_tokens"]
    assert sum(on["num_cached_tokens_per_request"]) == on["prefix_hit_tokens"]
    # Reused tokens are not computed again.
    assert on["num_batched_tokens"] == off["num_batched_tokens"] - on["prefix_hit_tokens"]
    for key in ("output_tokens_per_s", "total_tokens_per_s", "speedup_wall_time", "ttft_mean_speedup"):
        assert result["ratio_on_over_off"][key] > 0
    assert result["greedy_agreement"]["exact_match_fraction"] == 1.0


def test_migration_cost_part_of_cluster_benchmark(tmp_path: Path) -> None:
    out, plot = tmp_path / "cluster.json", tmp_path / "migration_cost.png"
    run_script(
        "cluster.py",
        "--policies",
        "",
        "--downtime-lengths",
        "96",
        "--repeats",
        "1",
        "--result-json",
        str(out),
        "--plot",
        str(plot),
    )
    rows = json.loads(out.read_text())["migration_cost"]
    assert [r["mode"] for r in rows] == ["live", "stop-and-copy", "recompute"]
    assert all(r["context_tokens"] == 96 and r["gap_over_itl"] > 0 and r["gap_ms"] > 0 for r in rows)
    live, stop_copy, _ = rows
    # A live move copied its full blocks in a stage while it decoded; stop-and-copy in none.
    assert live["stages"] >= 1 and stop_copy["stages"] == 0
    assert live["kv_bytes"] > 0 and stop_copy["kv_bytes"] > 0 and live["pause_ms"] > 0
    assert plot.stat().st_size > 0


def test_pd_threshold_part_of_pd_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    run_script(
        "pd.py", "--skip-load", "--threshold-lengths", "16,256", "--decoders", "2", "--result-json", str(out)
    )
    rows = json.loads(out.read_text())["threshold"]
    assert [r["prompt_len"] for r in rows] == [16, 256]
    assert all(r["handoff_stop_copy_ms"] > 0 and r["handoff_kv_bytes"] > 0 for r in rows)


def test_int4_quick(tmp_path: Path, llama_dir: Path) -> None:
    result_json = tmp_path / "int4.json"
    args = ["--quick", "--model", str(llama_dir), "--cache-dir", str(tmp_path / "cache"), "--result-json",
            str(result_json)]
    proc = run_script("int4.py", *args, timeout=240)
    assert "int4 / int8 c=1 decode" in proc.stdout
    result = json.loads(result_json.read_text())
    by = {r["variant"]: r for r in result["results"]}
    assert set(by) == {"float", "int8", "int4", "int4+int8"}
    assert "int4" in by["int4"]["linear_paths"]["down_proj"]
    # 4-bit weights (plus float32 group scales) are well under float32's.
    assert by["int4"]["weight_bytes"] < by["float"]["weight_bytes"]
    # quantization="int8" on the 4-bit checkpoint: the head goes to int8, the 4-bit layers stay.
    assert "int8" in by["int4+int8"]["linear_paths"]["lm_head"]
    assert "int4" in by["int4+int8"]["linear_paths"]["down_proj"]
    assert by["int4+int8"]["linear_bytes"] < by["int4"]["linear_bytes"] < by["int8"]["linear_bytes"] * 2
    assert len(by["int8"]["c1_decode_tok_s_runs"]) == 1
    assert "int4+int8_over_int8_c1_decode" in result["ratios"]
    assert all(r["c1_decode_tok_s"] > 0 and r["c4_output_tok_s"] > 0 for r in by.values())


def test_layer_ops_quick(tmp_path: Path, llama_dir: Path) -> None:
    result_json = tmp_path / "layer_ops.json"
    args = ["--quick", "--model", str(llama_dir), "--cache-dir", str(tmp_path / "cache"), "--result-json",
            str(result_json)]
    proc = run_script("layer_ops.py", *args, timeout=240)
    assert "c=1 decode" in proc.stdout
    result = json.loads(result_json.read_text())
    by = {r["variant"]: r for r in result["results"]}
    assert set(by) == {"int8", "int4+int8", "bfloat16"}
    for r in by.values():
        assert r["kernels_c1_decode_tok_s"] > 0 and r["torch_c1_decode_tok_s"] > 0
        assert r["c1_ratio"] == r["kernels_c1_decode_tok_s"] / r["torch_c1_decode_tok_s"]
        assert r["torch_c2_output_tok_s"] > 0 and len(r["c1_ratio_runs"]) == 1


def test_reliability_attacks_quick(tmp_path: Path) -> None:
    """benchmarks/reliability.py's memory and event-loop attacks, bounded: every nasty input is
    answered without a server error, salts and aborted grammars leave memory bounded (the figures
    themselves, /health latency among them, are the benchmark's, docs/benchmarks-features.md)."""
    result_json = tmp_path / "reliability.json"
    run_script(
        "reliability.py", "--quick", "--sections", "stall,salts,aborts,enums", "--result-json", str(result_json),
        timeout=600,
    )
    r = json.loads(result_json.read_text())
    statuses = {row["input"]: row["status"] for row in r["stall_probe"]}
    assert all(isinstance(s, int) and s < 500 for s in statuses.values()), statuses
    assert statuses["30 MB body without a key"] == 401
    assert statuses["Lark chain of 30,000 rules"] == 400
    assert statuses["60k-value enum (served)"] == 200
    salts = r["distinct_salts"]
    assert salts["ok"] == salts["requests"] and salts["huge_salt_statuses"] == [400]
    rss = salts["engine_rss_mb_by_round"]
    assert rss[-1] - rss[1] < 100, rss  # after the first round's warm-up: no growth per salt
    assert r["grammar_aborts"]["statuses"] == [200]
    assert r["grammar_aborts"]["seconds_until_idle_after_last"] is not None
    enums = r["enum_cache"]
    assert enums["statuses"] == [200]
    # 16 grammars of ~40 MB each: bounded by the cache's bytes, not held all.
    assert enums["engine_rss_mb"][-1] - enums["engine_rss_mb"][0] < 400, enums["engine_rss_mb"]


def test_per_token_cpu_quick(tmp_path: Path) -> None:
    """benchmarks/per_token_cpu.py end to end: the long-context model builds, every stream carries
    its tokens one per chunk, every window has both processes' figures (their values are the
    benchmark's, read on an idle machine)."""
    result_json = tmp_path / "per_token_cpu.json"
    proc = run_script(
        "per_token_cpu.py", "--quick", "--cache-dir", str(tmp_path / "cache"), "--result-json", str(result_json),
        timeout=600,
    )
    assert "longest / shortest" in proc.stdout
    r = json.loads(result_json.read_text())
    assert r["quick"] is True and r["lengths"] == [100, 800] and r["repeats"] == 1
    assert [w["length"] for w in r["windows"]] == [100, 800]
    for w in r["windows"]:
        assert w["window"][0] < w["window"][1] == w["length"]
        # A window's figure can be 0 on a loaded machine: when the client falls behind, a window's
        # tokens reach it in one burst and both readings come after the processes' work for them.
        # The run's totals (from before the request to after its end) cannot miss it.
        assert w["api_us_per_token"] >= 0 and w["engine_us_per_token"] >= 0
        assert all(run["tokens"] >= w["window"][1] - w["window"][0] for run in w["runs"])
    (request,) = r["requests"]
    # Each chunk holds what is new: never more chunks than tokens (and the finish).
    assert request["tokens"] == 800 and 0 < request["chunks"] <= 801
    assert request["api_cpu_s"] > 0 and request["engine_cpu_s"] > 0
    assert set(r["ratio_longest_over_shortest"]) == {"api", "engine"}
