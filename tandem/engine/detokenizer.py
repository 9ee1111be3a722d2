"""Incremental detokenization and stop-string detection for one output sequence."""

from __future__ import annotations

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from tandem.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context
# (leading spaces of metaspace tokenizers, characters split over tokens).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Appends text as tokens arrive; a character whose bytes span tokens appears once complete."""

    def __init__(self, tokenizer: RustTokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(
            ids=prompt_token_ids[-_CONTEXT_TOKENS:], skip_special_tokens=params.skip_special_tokens
        )
        self.stops = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.skip_special = params.skip_special_tokens
        # detokenize=False: token ids only (no stop strings either: SamplingParams refuses them).
        self.decodes = params.detokenize
        # As in vLLM, stop strings count only in text after the first `min_tokens` tokens.
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.text = ""
        # Tokens the stream has taken but not yet turned into text (an unfinished character).
        self.pending: list[int] = []

    def update(self, token_id: int, decode: bool = True) -> str | None:
        """Add one token's text; return the stop string if the text now contains one (text is cut there)."""
        self.num_tokens += 1
        if not decode or not self.decodes:
            return None
        self.pending.append(token_id)
        chunk = self.stream.step(self.tokenizer, token_id)
        if chunk is None:
            return None
        self.pending.clear()
        if not chunk:
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += chunk
        if not self.stops or self.num_tokens <= self.min_tokens:
            return None
        best = -1
        hit = None
        for stop in self.stops:
            pos = self.text.find(stop, start)
            if pos != -1 and (best == -1 or pos < best):
                best, hit = pos, stop
        if hit is not None:
            self.text = self.text[: best + len(hit)] if self.include_stop else self.text[:best]
        return hit

    def flush(self) -> None:
        """At the end of a sequence, render bytes of an unfinished character as the decoder would (U+FFFD)."""
        if self.pending:
            self.text += self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special)
            self.pending.clear()

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a tail that could still grow into a stop string."""
        if finished or not self.hold:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]
