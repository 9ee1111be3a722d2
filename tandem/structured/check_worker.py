"""The grammar check process: compiles specs as the engine will, where a crash costs nothing.

`tandem/structured/checker.py` starts it as `python -m tandem.structured.check_worker RFD WFD
STACK MEMORY` and talks over two pipes (`multiprocessing.connection` frames of JSON). The first
frame names the tokenizer; each later one is a spec, answered with a verdict: the error (None if
it compiles) and the tokens the grammar allows first, as bitmask words. Everything runs on one
thread with STACK bytes of stack, in an address space of MEMORY bytes: a spec that recurses deeper
or allocates more kills this process, which the checker reads as a refusal."""

from __future__ import annotations

import json
import resource
import sys
import threading
from multiprocessing.connection import Connection

import numpy as np

from tandem.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher

# An llguidance error carries a dump of the parser's state after its first line.
MAX_ERROR_CHARS = 400


def short_error(message: str) -> str:
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."


def _allowed(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def verdict(backend: LLGuidanceBackend, kind: str, text: str) -> tuple[str | None, bytes]:
    """(None, the first step's bitmask) if the spec compiles and can start; else (why not, b"")."""
    try:
        return _verdict(backend, kind, text)
    except Exception as exc:  # llguidance raises several types for a spec it cannot read
        return short_error(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)), b""


def _verdict(backend: LLGuidanceBackend, kind: str, text: str) -> tuple[str | None, bytes]:
    grammar = backend.compile(kind, text)
    matcher = grammar.matcher()
    inner = matcher.inner
    bitmask = np.zeros((1, backend.words), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    if inner.is_error():
        return f"the grammar cannot start: {short_error(inner.get_error())}", b""
    first = _allowed(bitmask[0], backend.vocab_size)
    if not len(first):
        return "the grammar allows no output", b""
    # One step in: a grammar beyond the engine's limits (a rule that only recurses, say) fails on
    # its first token, which would otherwise happen inside a serving step.
    eos = set(backend.eos_token_ids)
    probe = next((int(t) for t in first if int(t) not in eos), None)
    if probe is not None:
        step = LLGuidanceMatcher(inner.deep_copy())
        if not step.accept(probe) and step.inner.is_error():
            return f"the grammar exceeds the grammar engine's limits: {short_error(step.inner.get_error())}", b""
    return None, bitmask.tobytes()


def serve(rx: Connection, tx: Connection) -> None:
    init = json.loads(rx.recv_bytes())
    try:
        backend = LLGuidanceBackend(init["tokenizer"], init["vocab_size"], tuple(init["eos_token_ids"]))
    except Exception as exc:
        tx.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        return
    tx.send_bytes(b'{"ready": true}')
    while True:
        try:
            request = json.loads(rx.recv_bytes())
        except EOFError:
            return
        error, first = verdict(backend, request["kind"], request["text"])
        tx.send_bytes(json.dumps({"error": error}).encode())
        if error is None:
            tx.send_bytes(first)


def main() -> None:
    rfd, wfd, stack, memory = (int(a) for a in sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    rx, tx = Connection(rfd, writable=False), Connection(wfd, readable=False)
    threading.stack_size(stack)
    worker = threading.Thread(target=serve, args=(rx, tx), name="tandem-grammar-check")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
