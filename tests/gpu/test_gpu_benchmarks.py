"""benchmarks/gpu/ runs before a GPU session does: the config maker and each benchmark of bench.py
on a tiny shape on the CPU (the GPU session runs them at full size with --device cuda)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks/gpu/bench.py"


def run(*args: str) -> None:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-shape")
    run(str(ROOT / "benchmarks/gpu/make_config.py"), "--shape", "tiny", "--out", str(out))
    assert not list(out.glob("*.safetensors"))
    return out


@pytest.fixture(scope="module")
def limits(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("limits") / "limits.json"
    run(str(BENCH), "limits", "--device", "cpu", "--out", str(out))
    got = json.loads(out.read_text())["limits"]
    assert got["copy_bandwidth_bytes_per_s"] > 0 and got["bf16_gemm_flops_per_s"] > 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "bench, args, keys",
    [
        ("decode", ["--prompt-len", "16", "--output-len", "4"], ["fraction_of_roofline", "bytes_per_token"]),
        ("prefill", ["--tokens", "64", "--repeats", "1"], ["fraction_of_peak", "flops"]),
        (
            "throughput",
            ["--num-seqs", "3", "--min-len", "4", "--max-len", "8", "--max-num-seqs", "4"],
            ["output_tokens_per_s", "decode_fraction_of_roofline"],
        ),
        (
            "profile",
            ["--num-seqs", "3", "--prompt-len", "8", "--output-len", "8", "--profile-steps", "2"],
            ["step_s"],
        ),
    ],
)
def test_each_benchmark_writes_its_json(tiny, limits, tmp_path, bench, args, keys):
    out = tmp_path / f"{bench}.json"
    run(
        str(BENCH),
        bench,
        "--device",
        "cpu",
        "--model",
        str(tiny),
        "--limits",
        str(limits),
        "--out",
        str(out),
        *args,
    )
    result = json.loads(out.read_text())
    assert result["bench"] == bench and result["engine"]["plan"]["device"] == "cpu"
    for key in keys:
        assert result[key] is not None and result[key] > 0, (key, result[key])
