"""The llguidance grammar engine behind `backend.GrammarBackend`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import llguidance
import llguidance.numpy
import numpy as np

from tandem.structured.backend import FIELDS, Matcher, bitmask_words

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON written without free whitespace (vLLM's `disable_any_whitespace`): a model cannot loop on
# blanks between tokens, and every output still parses.
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar definition for a spec; ValueError naming the field if it is malformed."""
    field = FIELDS.get(kind)
    if field is None:
        raise ValueError(f"unknown structured output kind {kind!r}")
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(text))
            )
        # EBNF/GBNF (`::=` rules) or Lark.
        return llguidance.grammar_from("grammar", text)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{field} is not a valid grammar: {exc}") from None


class LLGuidanceMatcher:
    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        m = self._m
        if m.is_stopped() or m.is_error():  # nothing follows the end
            return False
        if not m.validate_tokens([token]):
            return False
        return bool(m.consume_token(token)) and not m.is_error()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._m, bitmask, row)

    @property
    def inner(self) -> llguidance.LLMatcher:
        return self._m

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())


class LLGuidanceGrammar:
    """A parsed grammar: a fresh matcher per sample is a copy of this one's start state."""

    __slots__ = ("_proto",)

    def __init__(self, proto: llguidance.LLMatcher) -> None:
        self._proto = proto

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._proto.deep_copy())


class LLGuidanceBackend:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        if not eos_token_ids:
            raise ValueError("structured output needs the model's EOS token id")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor()
        # The tokenizer may be shorter than the model's (padded) vocabulary: the extra ids are never
        # allowed under a grammar. Read from tokenizer.json directly where there is one (loading
        # `transformers` into the engine process costs seconds).
        path = Path(tokenizer_path) / "tokenizer.json"
        if path.is_file():
            self.tokenizer = llguidance.LLTokenizer(
                path.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=list(eos_token_ids)
            )
        else:
            from llguidance.hf import from_tokenizer

            from tandem.engine.tokenizer import Tokenizer

            hf: Any = Tokenizer(tokenizer_path).hf
            self.tokenizer = from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(eos_token_ids))

    def fill_bitmasks(self, items: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        if len(items) == 1:
            items[0][0].fill_bitmask(bitmask, items[0][1])
            return
        # llguidance's own thread pool, without the GIL.
        pairs = [(cast(LLGuidanceMatcher, m).inner, row) for m, row in items]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)

    def compile(self, kind: str, text: str) -> LLGuidanceGrammar:
        grammar = grammar_text(kind, text)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"{FIELDS[kind]} is not a valid grammar: {matcher.get_error().strip()}")
        return LLGuidanceGrammar(matcher)
