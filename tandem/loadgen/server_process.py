"""`tandem serve` as a child process on a free local port: start, wait for health, read metrics, stop.

Used by the server tests and the server benchmarks (benchmarks/reliability.py). Linux only for
`engine_pid` and `rss_kb` (they read /proc).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value}, labels sorted, model_name dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        pairs = sorted(p for p in re.findall(r'\w+="[^"]*"', labels) if not p.startswith("model_name="))
        out[name + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(value)
    return out


class ServerProcess:
    """`tandem serve MODEL ARGS...` in its own session (its engine process dies with it), logging to
    a temporary file; the constructor returns once /health answers 200. Leaving the `with` block
    normally removes the log; an exception keeps it for reading (its path is in `log_path`)."""

    def __init__(
        self,
        model: Path | str,
        *args: str,
        startup_timeout: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="tandem-serve-", suffix=".log")
        self.log = os.fdopen(fd, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "serve", str(model), "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, *args], stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server did not become healthy in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-6000:]

    @property
    def engine_pid(self) -> int:
        """The engine-core process: the server's spawned child (health does not say it)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:  # not multiprocessing's resource tracker
                return int(pid)
        raise RuntimeError(f"no engine process among the server's children {children}")

    def metrics_text(self, key: str | None = None) -> str:
        request = urllib.request.Request(self.url + "/metrics")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.read().decode()

    def metrics(self, key: str | None = None) -> dict[str, float]:
        return parse_metrics(self.metrics_text(key))

    def rss_kb(self) -> int:
        """Resident memory of the API and engine processes together."""
        total = 0
        for pid in (self.proc.pid, self.engine_pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            match = re.search(r"VmRSS:\s+(\d+)", status)
            total += int(match.group(1)) if match else 0
        return total

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the server drains and exits, taking what it started with it), then `kill`.
        Returns the exit code, or None if it had to be killed."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if not self.log.closed:
            self.log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.kill()
        if exc_type is None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
