"""Start `tandem serve` as a subprocess on a free local port, talk to it, stop it."""

from __future__ import annotations

import contextlib
import json
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

try:  # the openai client ships with httpx2; plain httpx works the same
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

# Small and fast: a tiny KV cache, a few sequences.
FAST_ARGS = ["--num-kv-blocks", "128", "--max-num-seqs", "8", "--num-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(
        self, model: Path | str, *args: str, startup_timeout: float = 180.0, env: dict[str, str] | None = None
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
                        self.health = json.loads(r.read())
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
        """The engine-core process: the server's child (health does not say it)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:  # not the resource tracker, the other child
                return int(pid)
        raise RuntimeError(f"no engine process among the server's children {children}")

    def client(self, api_key: str = "unused", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def metrics(self, key: str | None = None) -> dict[str, float]:
        """'name{label="v",...}' (labels sorted, model_name dropped) -> value, from /metrics."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        resp = httpx.get(self.url + "/metrics", timeout=10, headers=headers)
        resp.raise_for_status()
        text = resp.text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            name, _, labels = key.partition("{")
            pairs = sorted(p for p in re.findall(r'\w+="[^"]*"', labels) if not p.startswith("model_name="))
            out[name + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(value)
        return out

    def rss_kb(self) -> int:
        """Resident memory of the API and engine processes together."""
        total = 0
        for pid in (self.proc.pid, self.engine_pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        return total

    def kill(self) -> None:
        # The engine process is in the server's process group (its own session).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
