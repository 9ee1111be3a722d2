"""The peer-comparison script's table math: ratios to Tandem, decode speed from TPOT, failures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "run_peers.py"
spec = importlib.util.spec_from_file_location("run_peers", SCRIPT)
run_peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_peers)


def _result(out_tps: float, tpot_ms: float) -> dict:
    stats = {"median": tpot_ms, "p99": tpot_ms * 2, "mean": tpot_ms}
    return {
        "completed": 4,
        "failed": 0,
        "output_throughput": out_tps,
        "total_token_throughput": out_tps * 3,
        "ttft_ms": stats,
        "tpot_ms": stats,
        "itl_ms": stats,
        "e2el_ms": stats,
    }


def test_compare_ratios_and_markdown():
    results = {
        "tandem": _result(40.0, 100.0),
        "vllm": _result(20.0, 50.0),
        "transformers": {"completed": 4, "output_throughput": 10.0, "total_token_throughput": 30.0},
        "llamacpp": {"error": "RuntimeError: no binary"},
    }
    table = run_peers.compare(results, "tandem")
    rows = table["systems"]
    assert rows["tandem"]["out tok/s ratio"] == 1.0
    assert rows["vllm"]["out tok/s ratio"] == 0.5
    assert rows["vllm"]["decode tok/s"] == 20.0  # 1000 / 50 ms
    assert rows["vllm"]["decode tok/s ratio"] == 2.0  # tandem decodes at 10 tok/s
    assert rows["transformers"]["TTFT med ms"] is None
    assert rows["llamacpp"] == {"error": "RuntimeError: no binary"}
    md = run_peers.to_markdown({1: table, 8: table}, {"model": "m"})
    assert "## Concurrency 1" in md and "## Concurrency 8" in md
    assert "| vllm | 4 | 20 (2) |" in md
    assert "skipped: RuntimeError: no binary" in md


def test_gguf_variants_name_llamacpp_systems():
    assert run_peers.parse_ggufs(None) == {}
    assert run_peers.parse_ggufs("m.gguf") == {"llamacpp": "m.gguf"}
    assert run_peers.parse_ggufs("f16=a.gguf, q8_0=b.gguf") == {
        "llamacpp-f16": "a.gguf",
        "llamacpp-q8_0": "b.gguf",
    }


def test_a_repeated_system_keeps_each_round(tmp_path, monkeypatch):
    """Tandem run first and last: the second round is its own column and its own files, not an
    overwrite of the first (the first/last pair is how a table shows the machine's drift)."""
    rounds = []

    def fake_run_system(args, name):
        rounds.append(name)
        result = _result(10.0 * len(rounds), 100.0)
        (args.out_dir / f"{name}-c1.json").write_text(json.dumps(result))
        return {1: result}

    monkeypatch.setattr(run_peers, "run_system", fake_run_system)
    argv = ["--model", "m", "--systems", "tandem,vllm,tandem", "--levels", "1:4", "--out-dir", str(tmp_path)]
    assert run_peers.run_labels(["tandem", "vllm", "tandem", "tandem"]) == ["tandem", "vllm", "tandem-run2", "tandem-run3"]
    assert run_peers.main(argv) == 0
    assert rounds == ["tandem", "vllm", "tandem"]
    systems = json.loads((tmp_path / "comparison.json").read_text())["tables"]["1"]["systems"]
    assert systems["tandem"]["out tok/s"] == 10.0 and systems["tandem-run2"]["out tok/s"] == 30.0
    assert json.loads((tmp_path / "tandem-c1.json").read_text())["output_throughput"] == 10.0
    assert json.loads((tmp_path / "tandem-run2" / "tandem-c1.json").read_text())["output_throughput"] == 30.0
