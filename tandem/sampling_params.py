"""Per-request sampling parameters, named and defaulted as vLLM names them."""

from __future__ import annotations

import enum
import json as _json
from dataclasses import dataclass, is_dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, cast

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
# OpenAI's range for a logit_bias value; the most entries logit_bias and allowed_token_ids may hold
# (each is turned into a tensor row in every step). bad_words are bounded as stop strings are.
MAX_LOGIT_BIAS = 100.0
MAX_TOKEN_CONTROLS = 4096


# Bounds on a structured-output spec (compiling is the engine's work; a huge spec is refused here).
MAX_STRUCTURED_SPEC_CHARS = 1 << 20
MAX_STRUCTURED_CHOICES = 1024
# A JSON schema nested deeper than this is refused before anything recursive reads it (Python's
# json module and the schema compiler both recurse; llguidance itself stops at 128).
MAX_STRUCTURED_JSON_DEPTH = 128


def json_text_depth(text: str) -> int:
    """How deeply the arrays and objects of a JSON text nest (read without recursing: a text of
    any depth costs one pass, so the bound is checked before a recursive reader sees it)."""
    import re

    import numpy as np

    brackets = re.sub(r'[^\[\]{}"\\]+', "", text)
    if "{" not in brackets and "[" not in brackets:
        return 0
    # Drop string literals (their brackets do not nest): escapes first, then quoted spans.
    brackets = re.sub(r'"[^"]*"', "", re.sub(r"\\.", "", brackets))
    steps = np.frombuffer(brackets.encode("ascii", "ignore"), dtype=np.uint8)
    level = np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1))
    return int(level.max(initial=0))


def json_value_depth(value: Any) -> int:
    """How deeply the lists and dicts of a JSON value nest (without recursing)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_STRUCTURED_JSON_DEPTH:
            return depth  # deep enough to refuse: no need to walk the rest
        stack.extend((c, depth + 1) for c in children)
    return deepest


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds, as vLLM's: everything so far (CUMULATIVE, the
    default), only what is new since the previous output (DELTA: a stream's chunks, at a cost per
    output independent of the length so far), or one output when the request ends (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar, as vLLM's `StructuredOutputsParams`: exactly one of a JSON
    schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression,
    a list of choices, or a grammar (EBNF/GBNF or Lark)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {_short(self.json_object)}")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        name = given[0]
        if name == "json":
            text = self.json if isinstance(self.json, str) else None
            depth = json_value_depth(self.json) if text is None else json_text_depth(text)
            if depth > MAX_STRUCTURED_JSON_DEPTH:
                raise ValueError(
                    f"structured_outputs.json is nested more than {MAX_STRUCTURED_JSON_DEPTH} levels deep"
                )
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {_short(self.json)}")
        elif name in ("regex", "grammar"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {_short(value)}")
        elif name == "choice":
            choice = self.choice
            if (
                not isinstance(choice, list)
                or not choice
                or len(choice) > MAX_STRUCTURED_CHOICES
                or not all(isinstance(c, str) and c for c in choice)
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a list of 1 to {MAX_STRUCTURED_CHOICES} non-empty "
                    f"strings, got {_short(choice)}"
                )
        if len(self.spec()[1]) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{name} is longer than {MAX_STRUCTURED_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return self.spec()[0]

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints give equal keys (the compiled-grammar cache's).
        A schema's key order is kept: properties are generated in the order the schema lists them."""
        if self.json is not None:
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return "json", _json.dumps(schema, separators=(",", ":"))
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


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
    structured_outputs: StructuredOutputsParams | None = None
    # Token-level controls, applied in the batched sampler (tandem/worker/sampler.py).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token sequences: filled in from the tokenizer when the request is added.
    bad_words_token_ids: list[list[int]] | None = None
    # Keep only the last k prompt tokens (-1: the last max_model_len); None keeps the whole prompt.
    truncate_prompt_tokens: int | None = None
    # Logprobs of the prompt's tokens (each with this many top alternatives), computed in the prefill.
    prompt_logprobs: int | None = None
    # vLLM's older name for structured_outputs (a GuidedDecodingParams, or a dict of its fields):
    # moved there at construction, so it reads None afterwards (one spelling for the engine).
    guided_decoding: Any = None
    # False: the outputs carry token ids and no text, as in vLLM.
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

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
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError(
                    "SamplingParams.guided_decoding and structured_outputs are two names for one setting; "
                    "give one"
                )
            self.structured_outputs = structured_from_guided(self.guided_decoding)
            self.guided_decoding = None
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0
        if isinstance(self.logit_bias, dict):
            # Integer biases become floats: the sampler's bias row is float (the HTTP route parses floats).
            self.logit_bias = {
                t: float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                for t, v in self.logit_bias.items()
            }
        for name in ("allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
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
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "must be a boolean")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        if not self.detokenize and self.stop_strings:
            raise ValueError(
                "SamplingParams.stop: stop strings need detokenize=True (they are matched in the text)"
            )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        self._validate_token_controls()

    def _validate_token_controls(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {_short(getattr(self, name))}")

        def is_token(t: object) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to biases")
            if len(self.logit_bias) > MAX_TOKEN_CONTROLS:
                raise bad("logit_bias", f"must hold at most {MAX_TOKEN_CONTROLS} entries")
            for t, v in self.logit_bias.items():
                if not is_token(t):
                    raise bad("logit_bias", "keys must be non-negative token ids")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or not all(is_token(t) for t in ids):
                raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
            if len(ids) > MAX_TOKEN_CONTROLS:
                raise bad("allowed_token_ids", f"must hold at most {MAX_TOKEN_CONTROLS} ids")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
                raise bad("bad_words", "must be a list of non-empty strings")
            # Each word is tokenized twice when the request is added, in the API server's event loop.
            if len(words) > MAX_STOP_STRINGS or any(len(w) > MAX_STOP_STRING_CHARS for w in words):
                raise bad(
                    "bad_words",
                    f"must hold at most {MAX_STOP_STRINGS} words of at most {MAX_STOP_STRING_CHARS} characters",
                )
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, list) or not all(
                isinstance(s, list) and s and all(is_token(t) for t in s) for s in seqs
            ):
                raise bad("bad_words_token_ids", "must be a list of non-empty lists of token ids")
        if self.truncate_prompt_tokens is not None:
            k = self.truncate_prompt_tokens
            if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or 1 <= k <= INT32_MAX):
                raise bad("truncate_prompt_tokens", "must be -1 (max_model_len) or a positive integer")

    @property
    def uses_token_controls(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def clone(self, **changes: object) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["stop"] = list(self.stop_strings)
        values["stop_token_ids"] = list(self.stop_ids)
        for name in ("logit_bias", "allowed_token_ids", "bad_words", "bad_words_token_ids"):
            value = values[name]
            values[name] = None if value is None else type(value)(value)
        values.update(changes)
        return SamplingParams(**values)


# vLLM's older name for StructuredOutputsParams (the spec fields are the same).
GuidedDecodingParams = StructuredOutputsParams

# vLLM GuidedDecodingParams fields beyond the spec: those choosing an implementation (Tandem always
# uses llguidance) are ignored; those changing the output are refused, as the server refuses them.
_GUIDED_SPEC_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED_IGNORED_FIELDS = frozenset({"backend", "backend_was_auto", "disable_fallback"})
_GUIDED_REFUSED_FIELDS = frozenset(
    {"whitespace_pattern", "structural_tag", "disable_any_whitespace", "disable_additional_properties"}
)


def structured_from_guided(value: Any) -> StructuredOutputsParams:
    """vLLM's `guided_decoding` (a GuidedDecodingParams or any object or dict with its fields) as
    structured_outputs."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        given = dict(value)
    elif is_dataclass(value) and not isinstance(value, type):
        given = {f.name: getattr(value, f.name) for f in dataclass_fields(value)}
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        given = dict(vars(value))
    else:
        raise ValueError(
            "SamplingParams.guided_decoding must be a GuidedDecodingParams or a dict of its fields, "
            f"got {_short(value)}"
        )
    spec: dict[str, Any] = {}
    for name, field_value in given.items():
        if name in _GUIDED_SPEC_FIELDS:
            if field_value is not None and not (name == "json_object" and field_value is False):
                spec[name] = field_value
        elif name in _GUIDED_REFUSED_FIELDS:
            if field_value not in (None, False):
                raise ValueError(
                    f"SamplingParams.guided_decoding.{name} is not taken, got {_short(field_value)}"
                )
        elif name not in _GUIDED_IGNORED_FIELDS:
            raise ValueError(f"SamplingParams.guided_decoding.{name} is not a GuidedDecodingParams field")
    return StructuredOutputsParams(**spec)


def _short(value: object, limit: int = 200) -> str:
    """repr() cut to `limit` characters: error messages must not echo megabytes of input back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
