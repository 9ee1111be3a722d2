"""Failure and shutdown: the engine process dying mid-request, and SIGTERM draining."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from server_utils import RemoteServer, free_port

LONG = {"prompt": "while True:", "max_tokens": 8000, "ignore_eos": True}
# Room for two requests of 8000 tokens (a block of the tiny model is 8 KiB).
ARGS = ["--num-kv-blocks", "1100", "--max-num-seqs", "4", "--num-threads", "1"]


@pytest.fixture(scope="module")
def long_model(model_factory):
    """A context long enough that a request can outlast any test step (tokens take ~1ms here)."""
    return model_factory("llama", max_position_embeddings=16384)


def sse_events(lines) -> list:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.mark.slow
def test_engine_death_fails_requests_and_exits_nonzero(long_model):
    with RemoteServer(long_model, *ARGS) as server:
        results = {}

        def blocking_request():
            with server.http() as http:
                results["resp"] = http.post("/v1/completions", json=LONG)

        worker = threading.Thread(target=blocking_request)
        with (
            server.http() as http,
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp,
        ):
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            worker.start()
            # Both requests are in the engine before it dies.
            deadline = time.monotonic() + 10
            while server.metrics()["tandem:num_requests_running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(server.engine_pid, signal.SIGKILL)
            events = sse_events([first, *lines])
        worker.join(30)
        assert "error" in events[-1], events[-1]
        assert events[-1]["error"]["type"] == "server_error"
        assert results["resp"].status_code == 500
        assert set(results["resp"].json()["error"]) == {"message", "type", "param", "code"}
        assert server.proc.wait(30) != 0
        assert "engine" in server.logs()


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(long_model):
    """In-flight requests that finish within --drain-timeout finish; the rest are aborted; exit 0."""
    with RemoteServer(long_model, *ARGS, "--drain-timeout", "5") as server:
        short = {**LONG, "max_tokens": 20, "stream": True}
        long = {**LONG, "max_tokens": 8000, "stream": True}
        with (
            server.http() as http,
            http.stream("POST", "/v1/completions", json=short) as s1,
            http.stream("POST", "/v1/completions", json=long) as s2,
        ):
            assert s1.status_code == s2.status_code == 200
            lines1, lines2 = s1.iter_lines(), s2.iter_lines()
            first1 = next(line for line in lines1 if line.startswith("data: "))
            first2 = next(line for line in lines2 if line.startswith("data: "))
            server.proc.send_signal(signal.SIGTERM)
            # Not accepting any more work, while the in-flight requests go on. The signal is
            # handled asynchronously: on a loaded machine the first late request may still get in.
            deadline = time.monotonic() + 2.0
            while True:
                time.sleep(0.1)
                late = http.post("/v1/completions", json={**LONG, "max_tokens": 2})
                if late.status_code == 503 or time.monotonic() > deadline:
                    break
            assert late.status_code == 503
            assert late.json()["error"]["type"] == "server_error"
            finished = sse_events([first1, *lines1])
            aborted = sse_events([first2, *lines2])
        assert finished[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) for e in finished) > 0
        assert "error" in aborted[-1], aborted[-1]
        assert server.proc.wait(30) == 0


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "serve", *args, "--port", str(free_port())]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_serve_rejects_bad_arguments_before_starting(llama_dir, tmp_path):
    proc = run_serve(str(tmp_path))
    assert proc.returncode == 2 and "config.json" in proc.stderr
    proc = run_serve(str(llama_dir), "--speculative-config", '{"method": "magic"}')
    assert proc.returncode == 2 and "method" in proc.stderr
    keys = tmp_path / "keys.json"
    keys.write_text('{"k": {"tenant": "t", "max_concurrent": -1}}')
    proc = run_serve(str(llama_dir), "--api-keys-file", str(keys))
    assert proc.returncode == 2 and "max_concurrent" in proc.stderr
    assert "Traceback" not in proc.stderr
