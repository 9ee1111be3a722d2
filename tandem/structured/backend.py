"""The grammar engine behind structured output, as one small interface (the engine and the tests
see only this). The backend is llguidance (`llguidance_backend.py`): it compiles lazily (a grammar
is ready in well under a millisecond, against xgrammar's tens to hundreds on a 128k vocabulary),
its masks cost tens of microseconds a token on either vocabulary, it reads EBNF/GBNF and Lark
grammars, and it imports no torch (benchmarks/grammar_backends.py measures both engines). Specs are
checked before they are queued by `checker.py`, in separate processes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

# The field a spec of each kind came from, for error messages.
FIELDS = {
    "json": "structured_outputs.json",
    "json_object": "structured_outputs.json_object",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
}


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


def make_backend(tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarBackend:
    from tandem.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer_path, vocab_size, eos_token_ids)
