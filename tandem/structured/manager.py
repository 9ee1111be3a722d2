"""The engine's structured-output state: compiled grammars (an LRU keyed by spec, compiled off the
step loop), one matcher per constrained sample that follows the sample's tokens, and each step's
token bitmask for the constrained logits rows (the runner asks for it through `GrammarHook`)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tandem.core.request import Request
from tandem.sampling_params import StructuredOutputsParams
from tandem.structured.backend import CompiledGrammar, GrammarBackend, Matcher, bitmask_words, make_backend

SpecKey = tuple[str, str]


@dataclass(slots=True)
class _Tracked:
    grammar: CompiledGrammar
    matcher: Matcher
    num_accepted: int  # output tokens the matcher has consumed


class StructuredOutputManager:
    def __init__(
        self, tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.words = bitmask_words(vocab_size)
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[SpecKey, CompiledGrammar] = OrderedDict()
        self._compiling: dict[SpecKey, Future[CompiledGrammar]] = {}
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

    def prepare(self, params: StructuredOutputsParams) -> Future[CompiledGrammar] | None:
        """Start compiling a request's grammar on the compile thread; None if it is cached."""
        key = params.spec()
        if key in self._cache:
            self._cache.move_to_end(key)
            return None
        fut = self._compiling.get(key)
        if fut is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
            fut = self._compiling[key] = self._pool.submit(self._compile, key)
        return fut

    def grammar(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar (waiting for or running its compile here if it is not cached)."""
        key = params.spec()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        fut = self._compiling.pop(key, None)
        compiled = fut.result() if fut is not None else self._compile(key)
        self._cache[key] = compiled
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- matchers ------------------------------------------------------------------

    def matcher(self, req: Request) -> Matcher:
        """The request's matcher, advanced over every output token it has (built and replayed
        from the start for a request it has not seen: a fork, a resumed or moved request)."""
        sp = req.sampling.structured_outputs
        if sp is None:
            raise ValueError(f"request {req.request_id} has no structured output")
        t = self._tracked.get(req.request_id)
        outputs = req.num_output_tokens
        if t is None or t.num_accepted > outputs:
            grammar = self.grammar(sp) if t is None else t.grammar
            t = self._tracked[req.request_id] = _Tracked(grammar, grammar.matcher(), 0)
        if t.num_accepted < outputs:
            for tok in req.token_ids[req.num_prompt_tokens + t.num_accepted :]:
                if t.matcher.is_terminated():  # complete: what follows is EOS under ignore_eos
                    t.num_accepted = outputs
                    break
                if not t.matcher.accept(tok):
                    raise ValueError(
                        f"token {tok} of request {req.request_id} breaks its structured output grammar"
                    )
                t.num_accepted += 1
        return t.matcher

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
        is constrained. A request's rows are consecutive with growing drafts: the matcher walks
        the drafts as far as the grammar allows, masking each row from its state there, and is
        rolled back after; rows after a draft the grammar refuses are left unconstrained (the
        verifier never accepts past a token its masked row could not produce)."""
        if not any(r.sampling.structured_outputs is not None for r, _ in rows):
            return None
        start = time.perf_counter()
        constrained: list[int] = []
        bitmask = np.zeros((len(rows), self.words), dtype=np.int32)
        # Rows without drafts (most) are filled together at the end, in parallel where the backend can.
        batched: list[tuple[Matcher, int]] = []
        i = 0
        while i < len(rows):
            req = rows[i][0]
            if req.sampling.structured_outputs is None:
                i += 1
                continue
            m = self.matcher(req)
            if i + 1 == len(rows) or rows[i + 1][0] is not req:
                batched.append((m, len(constrained)))
                constrained.append(i)
                i += 1
                continue
            walked = 0  # drafts consumed so far
            valid = True
            while i < len(rows) and rows[i][0] is req:
                drafts = rows[i][1]
                if valid and len(drafts) > walked:
                    valid = m.accept(drafts[walked])
                    walked += valid
                if valid:
                    m.fill_bitmask(bitmask, len(constrained))
                    constrained.append(i)
                i += 1
            m.rollback(walked)
        if batched:
            self.backend.fill_bitmasks(batched, bitmask)
        bitmask = bitmask[: len(constrained)]
        for row in np.flatnonzero(~bitmask.any(axis=1)):  # a dead end: let the sample stop
            self._allow_eos(bitmask[row])
        self.mask_time_s += time.perf_counter() - start
        self.num_masked_rows += len(constrained)
        return constrained, bitmask

    def _allow_eos(self, words: np.ndarray) -> None:
        for eos in self.eos_token_ids:
            if eos < self.vocab_size:
                words.view(np.uint32)[eos // 32] |= np.uint32(1 << (eos % 32))
