"""`tandem chat` in a pseudo-terminal (what a user's terminal is): the prompt, a streamed reply, the
conversation kept between turns, /reset, /help, an unknown command, /exit and Ctrl-D; and, in
process, Ctrl-C stopping a reply and old turns dropped when the context is full. With the pulled
SmolLM2 (tests/conftest.py's smollm2_gguf), it answers a question sensibly."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from tandem.engine.llm_engine import LLMEngine
from tandem.entrypoints.chat import PROMPT, Chat
from tandem.sampling_params import SamplingParams

# The model loads and the kernels build (cached after the first run) before the first prompt.
START_TIMEOUT = 300.0
REPLY_TIMEOUT = 120.0


class Terminal:
    """A command on a pseudo-terminal: write lines, read until a pattern shows."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.entrypoints.cli", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            close_fds=True,
            start_new_session=True,
            env=dict(os.environ, TERM="dumb"),
        )
        os.close(slave)
        self.seen = ""

    def expect(self, pattern: str, timeout: float) -> str:
        """Everything read up to and including `pattern` (a regex); the rest is kept for later."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.seen)
            if m:
                before, self.seen = self.seen[: m.end()], self.seen[m.end() :]
                return before
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout}s; the terminal shows:\n{self.seen}")
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the other end closed
                    chunk = b""
                if not chunk and self.proc.poll() is not None:
                    raise AssertionError(f"exited ({self.proc.returncode}) before {pattern!r}:\n{self.seen}")
                self.seen += chunk.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            os.close(self.master)


PROMPT_RE = re.escape(PROMPT)


@pytest.mark.slow
def test_chat_in_a_terminal():
    term = Terminal(["chat", "--temperature", "0", "--max-tokens", "24", "--num-kv-blocks", "64"])
    try:
        banner = term.expect(PROMPT_RE, START_TIMEOUT)
        assert "tandem chat with tandem-default" in banner and "/reset" in banner
        term.send("def add(a, b):\n")
        first = term.expect(PROMPT_RE, REPLY_TIMEOUT)
        reply = first.split("def add(a, b):", 1)[1].removesuffix(PROMPT).strip()
        assert reply, f"no reply in {first!r}"
        term.send("/help\n")
        assert "/reset" in term.expect(PROMPT_RE, REPLY_TIMEOUT)
        term.send("/nonsense\n")
        assert "unknown command /nonsense" in term.expect(PROMPT_RE, REPLY_TIMEOUT)
        # The same message again, after a reset: greedy, so the same reply as the first time.
        term.send("/reset\n")
        assert "(new conversation)" in term.expect(PROMPT_RE, REPLY_TIMEOUT)
        term.send("def add(a, b):\n")
        again = term.expect(PROMPT_RE, REPLY_TIMEOUT)
        assert again.split("def add(a, b):", 1)[1].removesuffix(PROMPT).strip() == reply
        term.send("/exit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()


@pytest.mark.slow
def test_ctrl_d_leaves():
    term = Terminal(["chat", "--num-kv-blocks", "16"])
    try:
        term.expect(PROMPT_RE, START_TIMEOUT)
        term.send("\x04")  # Ctrl-D at an empty line: end of input
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()


@pytest.mark.slow
def test_chat_with_smollm2_answers(smollm2_gguf):
    term = Terminal(["chat", "--model", str(smollm2_gguf), "--temperature", "0", "--max-tokens", "32",
                     "--num-kv-blocks", "128"])  # fmt: skip
    try:
        term.expect(PROMPT_RE, START_TIMEOUT)
        # A question this 4-bit model answers in each arithmetic a CPU kind gives it: int8
        # activations against the 4-bit blocks (no AMX: as llama.cpp computes Q4_1, which answers
        # "What is the capital of France?" with "L'Étoile, la Marseillaise, ..." there too) and
        # bfloat16 activations (AMX tiles), as dequantized float32 and bfloat16 also answer it.
        term.send("What is the capital of Germany?\n")
        assert "Berlin" in term.expect(PROMPT_RE, REPLY_TIMEOUT)
        # The conversation is kept: the follow-up only makes sense with the first turn.
        term.send("And of Italy?\n")
        assert "Rome" in term.expect(PROMPT_RE, REPLY_TIMEOUT)
        term.send("/exit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()


class _Out:
    """A stream that sends this process SIGINT once the reply has started (a user's Ctrl-C)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        if not self.text and s.strip():
            os.kill(os.getpid(), signal.SIGINT)
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    from tandem.checkpoints import DEFAULT_MODEL_DIR
    from tandem.config import EngineConfig

    return LLMEngine(EngineConfig(model=str(DEFAULT_MODEL_DIR), num_kv_blocks=64, max_model_len=96))


def test_ctrl_c_stops_a_reply(engine):
    out = _Out()
    chat = Chat(engine, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), out=out)
    reply = chat.reply("def add(a, b):")
    assert out.text.rstrip().endswith("[stopped]")
    assert reply and reply in out.text
    assert chat.history[-1] == {"role": "assistant", "content": reply}
    assert not engine.has_unfinished_requests()
    # The engine goes on serving: the next turn completes.
    normal = Chat(engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), out=_Quiet())
    assert normal.reply("import os")


class _Quiet(_Out):
    def write(self, s: str) -> int:
        self.text += s
        return len(s)


def test_old_turns_are_dropped_when_the_context_is_full(engine):
    out = _Quiet()
    # max_model_len 96 with room for a 40-token reply: a few turns fill it.
    chat = Chat(engine, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), out=out)
    for i in range(4):
        chat.reply(f"message number {i} " + "x " * 8)
    assert "no longer fit the context: left out" in out.text
    assert chat.history[-1]["role"] == "assistant" and "message number 3" in chat.history[-2]["content"]
    assert len(engine.tokenizer.apply_chat_template(chat.history[:-1])) <= chat.max_prompt
    out.text = ""
    assert chat.reply("y " * 200) == ""
    assert "longer than the model's context allows" in out.text


def test_a_model_without_chat_template_is_refused(llama_dir, tmp_path):
    import shutil

    from tandem.config import EngineConfig

    plain = tmp_path / "plain"
    shutil.copytree(llama_dir, plain)
    config = plain / "tokenizer_config.json"
    cfg = {k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}
    config.write_text(json.dumps(cfg))
    for f in plain.glob("*.jinja"):
        f.unlink()
    eng = LLMEngine(EngineConfig(model=str(plain), num_kv_blocks=16))
    with pytest.raises(ValueError, match="no chat template"):
        Chat(eng, SamplingParams(max_tokens=4))
