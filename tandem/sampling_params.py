"""Per-request sampling parameters, named and defaulted as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

# Below this a temperature is treated as greedy decoding, as in vLLM.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# Bounds on what one request may ask of the per-token stop checks (stop strings are searched in the
# API process's event loop after every token; stop token ids are matched in the engine's step).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
# Counts (n, top_k, max_tokens, min_tokens) are 32-bit; seeds 64-bit.
INT32_MAX = 2**31 - 1


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Logprobs of the prompt's tokens (each with this many top alternatives), computed in the prefill.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"SamplingParams.stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0
        self.validate()

    # `stop` and `stop_token_ids` accept None or a single string at construction; __post_init__ makes
    # them lists. These read them as such (the type checker cannot follow __post_init__).
    @property
    def stop_strings(self) -> list[str]:
        return cast("list[str]", self.stop)

    @property
    def stop_ids(self) -> list[int]:
        return cast("list[int]", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {_short(getattr(self, name))}")

        def check_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")

        def check_num(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise bad(name, "must be a finite number")

        for name in ("n", "top_k", "min_tokens"):
            check_int(name)
            if getattr(self, name) > INT32_MAX:
                raise bad(name, "must be below 2**31")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            check_num(name)
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if not 0.0 <= self.temperature <= 1e4:
            raise bad("temperature", "must be in [0, 1e4]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", "must be in (0, 100]")
        if self.seed is not None:
            check_int("seed")
            # torch generators take 64-bit seeds; the engine adds an offset per sample for n > 1.
            if not -(2**63) <= self.seed < 2**63:
                raise bad("seed", "must fit in a signed 64-bit integer")
        if self.max_tokens is not None:
            check_int("max_tokens")
            if not 1 <= self.max_tokens <= INT32_MAX:
                raise bad("max_tokens", "must be in [1, 2**31)")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            check_int("logprobs")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs")
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop holds {len(self.stop_strings)} strings, more than {MAX_STOP_STRINGS}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {_short(self.stop_strings)}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"SamplingParams.stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(s)}"
                )
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"SamplingParams.stop strings must be valid Unicode (no lone surrogates), got {s!r}"
                ) from None
        if len(self.stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"SamplingParams.stop_token_ids holds {len(self.stop_ids)} ids, more than {MAX_STOP_TOKEN_IDS}"
            )
        for t in self.stop_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
                raise ValueError(
                    f"SamplingParams.stop_token_ids must hold non-negative 32-bit integers, "
                    f"got {_short(self.stop_ids)}"
                )

    def clone(self, **changes: object) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["stop"] = list(self.stop_strings)
        values["stop_token_ids"] = list(self.stop_ids)
        values.update(changes)
        return SamplingParams(**values)


def _short(value: object, limit: int = 200) -> str:
    """repr() cut to `limit` characters: error messages must not echo megabytes of input back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
