"""Incremental detokenization and stop-string detection for one output sequence."""

from __future__ import annotations

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from tandem.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context
# (leading spaces of metaspace tokenizers, characters split over tokens).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Appends text as tokens arrive; a character whose bytes span tokens appears once complete.

    The text is kept as pieces that can no longer change plus a tail of the last `hold` characters
    (where a stop string may still begin), so a token costs the same whatever the text's length:
    the stop-string search reads the tail and the new piece only, and `take_text` hands out the
    pieces gathered since it last did (and lets them go) without joining the rest."""

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
        # The text not handed out by `take_text` is "".join(fixed) + tail: tail is the text's
        # last `hold` characters (fewer while it is shorter), the only ones a later stop string
        # can still cut or show.
        self.fixed: list[str] = []
        self.tail = ""
        # Tokens the stream has taken but not yet turned into text (an unfinished character).
        self.pending: list[int] = []

    @property
    def text(self) -> str:
        """The text so far, less what `take_text` handed out (joined on every call)."""
        return "".join(self.fixed) + self.tail

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
        # A stop string ending in the new piece starts at most `hold` characters before it.
        window = self.tail + chunk
        hit = None
        if self.stops and self.num_tokens > self.min_tokens:
            best = -1
            for stop in self.stops:
                pos = window.find(stop)
                if pos != -1 and (best == -1 or pos < best):
                    best, hit = pos, stop
            if hit is not None:
                window = window[: best + len(hit)] if self.include_stop else window[:best]
        self._set_end(window)
        return hit

    def _set_end(self, window: str) -> None:
        """The text's end is now `window` (the old tail and what follows it)."""
        cut = len(window) - self.hold
        if cut > 0:
            self.fixed.append(window[:cut])
            self.tail = window[cut:]
        else:
            self.tail = window

    def flush(self) -> None:
        """At the end of a sequence, render bytes of an unfinished character as the decoder would (U+FFFD)."""
        if self.pending:
            self._set_end(self.tail + self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special))
            self.pending.clear()

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a tail that could still grow into a stop string."""
        return self.text if finished else "".join(self.fixed)

    def take_text(self, finished: bool) -> str:
        """The visible text not handed out by an earlier call (with `finished`, all the rest): the
        caller keeps it from then on, so a long sequence holds no text here (a delta output)."""
        new, self.fixed = self.fixed, []
        if finished:
            new.append(self.tail)
            self.tail = ""
        return "".join(new)
