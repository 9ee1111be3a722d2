"""Tandem: an LLM inference serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.entrypoints.llm import LLM

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Importing torch takes seconds; do it only when the engine is really used.
    if name == "LLM":
        from tandem.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
