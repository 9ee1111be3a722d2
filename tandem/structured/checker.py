"""Checking a structured-output spec before it is queued, in check processes where a crash costs
nothing (`check_worker.py`).

llguidance's compiler recurses natively once per nesting level of a grammar, so a spec far under
the size cap (a chain of rules, nested `$ref`s) can overflow a thread's stack and kill the process
it runs in, with no Python exception to catch. The API process (and the offline `LLM`) therefore
never compiles a spec itself: a check process compiles it against the model's tokenizer, exactly
as the engine will, on a stack a quarter of the engine's compile thread's
(`GrammarLimits.compile_stack_bytes`). A spec that crashes the check process or outlasts the
timeout is refused with a ValueError naming its field; a new process replaces the lost one."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from tandem.sampling_params import StructuredOutputsParams
from tandem.structured.backend import FIELDS
from tandem.structured.config import DEFAULT_LIMITS, MIB, GrammarLimits

logger = logging.getLogger("tandem.structured")

@dataclass(frozen=True, slots=True)
class Verdict:
    """A spec that compiles: the tokens its grammar allows first (int32 bitmask words)."""

    first_tokens: np.ndarray

    def allows_any(self, allowed: Sequence[int] | None, banned: Sequence[int]) -> bool:
        """Whether some first token is in `allowed` (None: any) and not in `banned`."""
        bits = np.unpackbits(self.first_tokens.view(np.uint8), bitorder="little").astype(bool)
        if allowed is not None:
            keep = np.zeros_like(bits)
            ids = np.asarray([t for t in allowed if 0 <= t < len(bits)], dtype=np.int64)
            keep[ids] = True
            bits &= keep
        if banned:
            ids = np.asarray([t for t in banned if 0 <= t < len(bits)], dtype=np.int64)
            bits[ids] = False
        return bool(bits.any())


class _CheckProcess:
    """One check process and the two pipes to it."""

    def __init__(self, init: bytes, limits: GrammarLimits) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        args = [str(to_child_r), str(from_child_w), str(limits.check_stack_bytes), str(limits.check_memory_bytes)]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.structured.check_worker", *args],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.tx = Connection(to_child_w, readable=False)
        self.rx = Connection(from_child_r, writable=False)
        self.tx.send_bytes(init)
        if not self.rx.poll(limits.check_start_timeout_s):
            self.kill()
            raise RuntimeError(f"the grammar check process did not start in {limits.check_start_timeout_s} s")
        try:
            reply = _json_loads(self.rx.recv_bytes())
        except EOFError:
            code = self.kill()
            raise RuntimeError(f"the grammar check process exited at start ({_exit_reason(code)})") from None
        if "error" in reply:
            self.kill()
            raise RuntimeError(f"the grammar check process cannot start: {reply['error']}")

    def ask(self, kind: str, text: str, timeout: float) -> tuple[str | None, bytes]:
        """(error, first bitmask); raises TimeoutError, or EOFError if the process died."""
        self.tx.send_bytes(_json_dumps({"kind": kind, "text": text}))
        if not self.rx.poll(timeout):
            raise TimeoutError
        reply = _json_loads(self.rx.recv_bytes())
        error = reply["error"]
        if error is not None:
            return error, b""
        if not self.rx.poll(timeout):
            raise TimeoutError
        return None, self.rx.recv_bytes()

    def kill(self) -> int | None:
        for conn in (self.tx, self.rx):
            conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


class GrammarChecker:
    """Thread-safe: the API process checks from several threads at once, each check on a check
    process of its own (at most `limits.check_processes`, started when first needed)."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        timeout_s: float | None = None,
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> None:
        self.limits = limits
        self.timeout_s = limits.check_timeout_s if timeout_s is None else timeout_s
        self.words = (vocab_size + 31) // 32
        self._init = _json_dumps(
            {"tokenizer": tokenizer_path, "vocab_size": vocab_size, "eos_token_ids": list(eos_token_ids)}
        )
        self._idle: list[_CheckProcess] = []
        self._closed = False
        self._running = 0  # processes started and not lost
        self._ready = threading.Condition()
        # digest of (kind, text) -> error message, or the verdict of a spec that compiles
        self._verdicts: OrderedDict[bytes, str | Verdict] = OrderedDict()
        self.num_refused_crash = 0
        self.num_refused_timeout = 0

    def check(
        self,
        params: StructuredOutputsParams,
        allowed_token_ids: Sequence[int] | None = None,
        banned_token_ids: Sequence[int] = (),
    ) -> Verdict:
        """The spec's verdict; ValueError naming the field if it does not compile, cannot start,
        or no first token is left by `allowed_token_ids` less `banned_token_ids`."""
        kind, text = params.spec()
        field = FIELDS[kind]
        key = hashlib.blake2b(f"{kind}\0{text}".encode("utf-8", "surrogatepass"), digest_size=20).digest()
        with self._ready:
            found = self._verdicts.get(key)
            if found is not None:
                self._verdicts.move_to_end(key)
        if found is None:
            found = self._ask(kind, text, field)
            with self._ready:
                self._verdicts[key] = found
                while len(self._verdicts) > self.limits.check_verdicts:
                    self._verdicts.popitem(last=False)
        if isinstance(found, str):
            raise ValueError(found)
        if (allowed_token_ids is not None or banned_token_ids) and not found.allows_any(
            allowed_token_ids, banned_token_ids
        ):
            raise ValueError(
                f"{field} allows no first token that allowed_token_ids and bad_words leave: "
                "no output could satisfy both"
            )
        return found

    def _ask(self, kind: str, text: str, field: str) -> str | Verdict:
        proc = self._acquire()
        try:
            error, first = proc.ask(kind, text, self.timeout_s)
        except TimeoutError:
            proc.kill()
            self._lose()
            self.num_refused_timeout += 1
            logger.warning("a %s of %d characters took over %s s to compile: refused", field, len(text), self.timeout_s)
            return f"{field} took longer than {self.timeout_s} s to compile: it is too complex"
        except (EOFError, OSError):
            code = proc.kill()
            self._lose()
            self.num_refused_crash += 1
            logger.warning(
                "a %s of %d characters crashed the grammar check process (%s): refused",
                field, len(text), _exit_reason(code),
            )
            return (
                f"{field} is too complex for the grammar engine: compiling it needs more than "
                f"{self.limits.check_stack_bytes // MIB} MiB of stack or "
                f"{self.limits.check_memory_bytes // MIB} MiB of memory (nesting too deep, or too large)"
            )
        self._release(proc)
        if error is not None:
            return error if error.startswith(field) else f"{field}: {error}"
        return Verdict(np.frombuffer(first, dtype=np.int32).copy())

    def _acquire(self) -> _CheckProcess:
        with self._ready:
            while not self._idle and self._running >= self.limits.check_processes:
                self._ready.wait()
            if self._idle:
                return self._idle.pop()
            self._running += 1
        try:
            return _CheckProcess(self._init, self.limits)
        except BaseException:
            self._lose()
            raise

    def _release(self, proc: _CheckProcess) -> None:
        with self._ready:
            if not self._closed:
                self._idle.append(proc)
                self._ready.notify()
                return
            self._running -= 1
        proc.kill()

    def _lose(self) -> None:
        with self._ready:
            self._running -= 1
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            idle, self._idle = self._idle, []
            self._running -= len(idle)
        for proc in idle:
            proc.kill()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _json_dumps(value: object) -> bytes:
    return json.dumps(value).encode("ascii")


def _json_loads(data: bytes) -> dict:
    return json.loads(data)
