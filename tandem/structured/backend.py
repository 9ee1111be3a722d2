"""The grammar engine behind structured output, as one small interface (the engine and the tests
see only this). The backend is llguidance (`llguidance_backend.py`): it compiles lazily (a grammar
is ready in well under a millisecond, against xgrammar's tens to hundreds on a 128k vocabulary),
its masks cost tens of microseconds a token on either vocabulary, it reads EBNF/GBNF and Lark
grammars, and it imports no torch, so the API process can check a spec before queuing it
(benchmarks/grammar_backends.py measures both engines)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tandem.sampling_params import StructuredOutputsParams


class Matcher(Protocol):
    """One sample's position in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (and no change) if the grammar does not allow it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words, bit `t % 32` of word
        `t // 32` set where token `t` is allowed). A finished grammar allows only EOS."""
        ...

    def is_terminated(self) -> bool: ...


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, kind: str, text: str) -> CompiledGrammar:
        """The grammar for a spec (`StructuredOutputsParams.spec()`); ValueError naming the field if
        it does not compile."""
        ...

    def fill_bitmasks(self, items: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """`Matcher.fill_bitmask` for several matchers (each its own row), in parallel where it can."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def check_spec(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the field if the spec cannot compile (no tokenizer needed: this runs
    in the API process, so a bad schema or regex is a 400, not an engine-side failure)."""
    from tandem.structured.llguidance_backend import check

    kind, text = params.spec()
    check(kind, text)


def make_backend(tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarBackend:
    from tandem.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer_path, vocab_size, eos_token_ids)
