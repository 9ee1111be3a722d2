"""Every code block of README.md runs as written on the embedded default model: shell blocks line by
line (a `tandem serve` line starts the server that the later curl, openai and bench blocks talk
to), python blocks as scripts. The one change made to the text is the port: 8000 becomes a free
one, since tests run side by side. Blocks that install packages or run the test suite are skipped,
by the explicit list below."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# First lines of the blocks not run here, and why.
SKIPPED = {
    'pip install -e ".[dev]"': "installs the package and runs the whole test suite",
    "python -m pytest tests/core                      # the torch-free core, about 15 s": "runs the test suite",
    'pip install -e ".[cluster]"   # Ray (the dev extra includes it)': "installs Ray and starts a Ray cluster",
    "tandem pull smollm2-135m-instruct": "downloads a 98 MB model; tests/engine/test_chat.py chats with it in a "
    "pseudo-terminal and tests/engine/test_pull.py pulls from a local index",
}
COMMAND_TIMEOUT = 180
# As tests/server/server_utils.py allows a server to start on a loaded machine.
STARTUP_TIMEOUT = 180

pytestmark = [pytest.mark.server, pytest.mark.slow]


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(bash|python)\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def commands(script: str) -> list[str]:
    """Shell lines with their backslash continuations joined."""
    return [c.strip() for c in script.replace("\\\n", " ").splitlines() if c.strip()]


class Servers:
    """The `tandem serve` process the blocks start: one at a time on the port, so a block with
    other flags replaces the server before it (a second server could not bind the port, and the
    first would answer its health check and its requests)."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd = env, cwd
        self.procs: dict[str, subprocess.Popen] = {}
        self.current: str | None = None
        self.started = 0

    def start(self, command: str, port: int) -> None:
        command = command.rstrip("&").strip()
        if command == self.current:
            return  # the same server, already up
        self.stop()
        self.procs = {}
        self.current = command
        self.started += 1
        log_path = self.cwd / f"serve-{self.started}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {command}"], cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.procs[command] = proc
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"{command!r} did not become healthy")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def test_skip_list_names_real_blocks():
    firsts = {code.splitlines()[0] for _, code in blocks()}
    assert set(SKIPPED) <= firsts


def test_readme_blocks_run_verbatim(tmp_path):
    port = free_port()
    shim = tmp_path / "bin"
    shim.mkdir()
    # `tandem` as a fresh install's console script would run it, from this checkout.
    (shim / "tandem").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tandem.entrypoints.cli "$@"\n')
    (shim / "tandem").chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{shim}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        TOKENIZERS_PARALLELISM="false",
    )
    servers = Servers(env, tmp_path)
    ran = 0
    try:
        for lang, code in blocks():
            if code.splitlines()[0] in SKIPPED:
                continue
            code = code.replace("8000", str(port))
            if lang == "python":
                script = tmp_path / f"block{ran}.py"
                script.write_text(code)
                cmds = [f'"{sys.executable}" {script}']
            else:
                cmds = commands(code)
            for cmd in cmds:
                t0 = time.monotonic()
                if cmd.startswith("tandem serve"):
                    servers.start(cmd, port)
                    print(f"{time.monotonic() - t0:5.1f}s {cmd[:80]}")
                    continue
                # No input: an interactive command (`tandem chat`) sees its end at once.
                proc = subprocess.run(
                    ["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                    timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL,
                )  # fmt: skip
                assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
                assert proc.stdout.strip(), f"{cmd} printed nothing"
                print(f"{time.monotonic() - t0:5.1f}s {cmd[:80]}")
            ran += 1
    finally:
        servers.stop()
    assert ran >= 6
    assert (tmp_path / "result.json").is_file() and (tmp_path / "plots" / "throughput_vs_latency.png").is_file()
