"""The engine's structured-output state: compiled grammars (an LRU keyed by spec and bounded by
entries and by memory, compiled off the step loop), one matcher per constrained sample that follows
the sample's tokens, and each step's token bitmask for the constrained logits rows (the runner
asks for it through `GrammarHook`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.core.request import Request
from tandem.sampling_params import StructuredOutputsParams
from tandem.structured.backend import CompiledGrammar, GrammarBackend, Matcher, bitmask_words, make_backend
from tandem.structured.config import DEFAULT_LIMITS, GrammarLimits

SpecKey = tuple[str, str]

logger = logging.getLogger("tandem.structured")


@dataclass(slots=True)
class _Tracked:
    grammar: CompiledGrammar
    matcher: Matcher
    num_accepted: int  # output tokens the matcher has consumed
    # The matcher refused a token the sample has (the grammar engine hit a limit, or a moved
    # request's tokens do not follow the grammar): the sample has no allowed token left.
    broken: bool = False


@dataclass(slots=True)
class _Pending:
    future: Future[CompiledGrammar]
    waiters: set[str] = field(default_factory=set)  # request ids


class CompileThread:
    """One thread, with a stack of `stack_bytes`, running compiles in submission order. The
    grammar compiler recurses natively per nesting level: on this stack, four times the check
    process's, whatever passed the check compiles (tandem/structured/checker.py)."""

    def __init__(self, stack_bytes: int) -> None:
        self.stack_bytes = stack_bytes
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-grammar", daemon=True)
            # threading.stack_size applies to threads started while it is set.
            previous = threading.stack_size(self.stack_bytes)
            try:
                self._thread.start()
            finally:
                threading.stack_size(previous)
        self._queue.put((fut, fn))
        return fut

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn = item
            if not fut.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        cache_size: int,
        cache_bytes: int | None = None,
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.limits = limits
        self.words = bitmask_words(vocab_size)
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._compiler = CompileThread(limits.compile_stack_bytes)
        # spec -> (grammar, bytes it is charged)
        self._cache: OrderedDict[SpecKey, tuple[CompiledGrammar, int]] = OrderedDict()
        self.cached_bytes = 0
        self._compiling: dict[SpecKey, _Pending] = {}
        self._tracked: dict[str, _Tracked] = {}
        # Time spent computing masks (for the benchmark's "mask cost as a fraction of a step").
        self.mask_time_s = 0.0
        self.num_masked_rows = 0

    # -- compiling ---------------------------------------------------------------

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:  # the compile thread and the step loop may both be first
            if self._backend is None:
                self._backend = make_backend(self.tokenizer_path, self.vocab_size, self.eos_token_ids)
            return self._backend

    def _compile(self, key: SpecKey) -> CompiledGrammar:
        return self.backend.compile(*key)

    def prepare(self, request_id: str, params: StructuredOutputsParams) -> Future[CompiledGrammar] | None:
        """Start compiling a request's grammar on the compile thread; None if it is cached. The
        request waits for it until `grammar` takes it, or `release` says it no longer does."""
        key = params.spec()
        if key in self._cache:
            self._cache.move_to_end(key)
            return None
        pending = self._compiling.get(key)
        if pending is None:
            pending = self._compiling[key] = _Pending(self._compiler.submit(lambda: self._compile(key)))
        pending.waiters.add(request_id)
        return pending.future

    def release(self, request_id: str, params: StructuredOutputsParams) -> None:
        """`request_id` no longer waits for its grammar (aborted, failed): a compile nobody waits
        for is cancelled if it has not started, and its result dropped if it has."""
        key = params.spec()
        pending = self._compiling.get(key)
        if pending is None:
            return
        pending.waiters.discard(request_id)
        if not pending.waiters:
            pending.future.cancel()
            del self._compiling[key]

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def grammar(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar (waiting for its compile, or compiling it on the compile thread, if
        it is not cached)."""
        key = params.spec()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit[0]
        pending = self._compiling.pop(key, None)
        fut = pending.future if pending is not None else self._compiler.submit(lambda: self._compile(key))
        compiled = fut.result()
        self._store(key, compiled)
        return compiled

    def _store(self, key: SpecKey, compiled: CompiledGrammar) -> None:
        if key in self._cache:
            self._cache.move_to_end(key)
            return
        size = self.limits.grammar_bytes(len(key[1]))
        self._cache[key] = (compiled, size)
        self.cached_bytes += size
        budget = self.cache_bytes
        while len(self._cache) > 1 and (
            len(self._cache) > self.cache_size or (budget is not None and self.cached_bytes > budget)
        ):
            _, (_, freed) = self._cache.popitem(last=False)
            self.cached_bytes -= freed

    def close(self) -> None:
        for pending in self._compiling.values():
            pending.future.cancel()
        self._compiling.clear()
        self._compiler.close()

    # -- matchers ------------------------------------------------------------------

    def matcher(self, req: Request) -> Matcher:
        """The request's matcher, advanced over every output token it has (built and replayed
        from the start for a request it has not seen: a fork, a resumed or moved request)."""
        return self._track(req).matcher

    def _track(self, req: Request) -> _Tracked:
        sp = req.sampling.structured_outputs
        if sp is None:
            raise ValueError(f"request {req.request_id} has no structured output")
        t = self._tracked.get(req.request_id)
        outputs = req.num_output_tokens
        if t is None or t.num_accepted > outputs:
            grammar = self.grammar(sp) if t is None else t.grammar
            t = self._tracked[req.request_id] = _Tracked(grammar, grammar.matcher(), 0)
        if t.num_accepted < outputs and not t.broken:
            for tok in req.token_ids[req.num_prompt_tokens + t.num_accepted :]:
                if t.matcher.is_terminated():  # complete: what follows is EOS under ignore_eos
                    t.num_accepted = outputs
                    break
                if not t.matcher.accept(tok):
                    t.broken = True
                    logger.warning(
                        "request %s: its grammar refuses its output token %d (%d in): the sample ends",
                        req.request_id, tok, t.num_accepted,
                    )
                    break
                t.num_accepted += 1
        return t

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._tracked.pop(rid, None)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    # -- the step's mask (GrammarHook) ---------------------------------------------

    def token_bitmask(self, rows: Sequence[tuple[Request, list[int]]]) -> tuple[list[int], np.ndarray] | None:
        """The constrained rows among a step's logits rows (a request and the draft tokens before
        the row) and their allowed tokens as a bitmask `[len(constrained), words]`; None if no row
        is constrained. A request's rows are consecutive, each with the drafts before it (a chain's
        grow by one; a tree's are each node's path): the matcher walks each row's drafts from where
        the previous row's left it (rolled back to their common part), masking the row from its
        state there, and is rolled back after; a row behind a draft the grammar refuses is left
        unconstrained (the verifier never accepts past a token its masked row could not
        produce)."""
        if not any(r.sampling.structured_outputs is not None for r, _ in rows):
            return None
        start = time.perf_counter()
        constrained: list[int] = []
        bitmask = np.zeros((len(rows), self.words), dtype=np.int32)
        # Rows without drafts (most) are filled together at the end, in parallel where the backend can.
        batched: list[tuple[Matcher, int]] = []
        i = 0
        dead: list[int] = []  # constrained rows of broken matchers: nothing allowed, not even EOS
        while i < len(rows):
            req = rows[i][0]
            if req.sampling.structured_outputs is None:
                i += 1
                continue
            t = self._track(req)
            if t.broken:
                while i < len(rows) and rows[i][0] is req:
                    dead.append(len(constrained))
                    constrained.append(i)
                    i += 1
                continue
            m = t.matcher
            if i + 1 == len(rows) or rows[i + 1][0] is not req:
                batched.append((m, len(constrained)))
                constrained.append(i)
                i += 1
                continue
            # The drafts walked so far, each with whether the matcher consumed it (an EOS after
            # the grammar is complete, under ignore_eos, is walked over without being consumed).
            walked: list[tuple[int, bool]] = []
            while i < len(rows) and rows[i][0] is req:
                history = rows[i][1]
                same = 0  # a tree's next row may branch off: keep the common part, undo the rest
                while same < min(len(walked), len(history)) and walked[same][0] == history[same]:
                    same += 1
                undo = sum(consumed for _, consumed in walked[same:])
                if undo:
                    m.rollback(undo)
                del walked[same:]
                valid = True
                for token in history[same:]:
                    if m.is_terminated() and token in self.eos_token_ids:
                        walked.append((token, False))
                    elif m.accept(token):
                        walked.append((token, True))
                    else:
                        valid = False
                        break
                if valid:
                    m.fill_bitmask(bitmask, len(constrained))
                    constrained.append(i)
                i += 1
            m.rollback(sum(consumed for _, consumed in walked))
        if batched:
            self.backend.fill_bitmasks(batched, bitmask)
        bitmask = bitmask[: len(constrained)]
        empty = np.logical_not(bitmask.any(axis=1))
        empty[dead] = False
        for row in np.flatnonzero(empty):  # a dead end of the grammar: let the sample stop
            self._allow_eos(bitmask[row])
        self.mask_time_s += time.perf_counter() - start
        self.num_masked_rows += len(constrained)
        return constrained, bitmask

    def _allow_eos(self, words: np.ndarray) -> None:
        for eos in self.eos_token_ids:
            if eos < self.vocab_size:
                words.view(np.uint32)[eos // 32] |= np.uint32(1 << (eos % 32))
