"""The `tandem` command, run as a user would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem import LLM, SamplingParams


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_generate_streams_the_offline_result(llama_dir):
    prompt = "def fibonacci(n):"
    proc = run_cli(
        "generate", "--model", str(llama_dir), "--prompt", prompt, "--max-tokens", "8", "--ignore-eos"
    )
    assert proc.returncode == 0, proc.stderr
    expected = LLM(str(llama_dir)).generate(
        prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert proc.stdout == prompt + expected.outputs[0].text + "\n"


def test_generate_reports_bad_model_clearly(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert proc.returncode == 2
    assert "config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_rejects_bad_sampling_value(llama_dir):
    proc = run_cli("generate", "--model", str(llama_dir), "--prompt", "x", "--top-p", "0")
    assert proc.returncode == 2
    assert "top_p" in proc.stderr
