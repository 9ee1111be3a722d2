"""`speculative_config`, as vLLM spells it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    # Choose each request's draft length per step from measured costs and acceptance (0 allowed);
    # num_speculative_tokens is the upper bound. False: always propose the maximum.
    adaptive: bool = True

    @staticmethod
    def from_dict(spec: dict[str, Any] | None) -> SpeculativeConfig | None:
        if spec is None:
            return None
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            "adaptive",
        }
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        method = spec.get("method")
        if method is None and spec.get("model"):
            method = "draft_model"
        if method == "draft":
            method = "draft_model"
        # As vLLM: a bound given alone (None counts as not given) also sets the other one.
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = 1, 4
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        cfg = SpeculativeConfig(
            method=str(method),
            num_speculative_tokens=spec.get("num_speculative_tokens", 0),
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            model=spec.get("model"),
            adaptive=spec.get("adaptive", True),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in [1, 16], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(
                    "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                    f"got {lo!r} and {hi!r}"
                )
        elif not self.model:
            raise ValueError(
                "speculative_config with method 'draft_model' needs 'model' (a checkpoint folder)"
            )
