"""Prompt logprobs in responses: vLLM's `prompt_logprobs` field (completions' choices, chat's top level)."""

from __future__ import annotations

from tandem.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs
from tandem.outputs import Logprob

# JSON has no -Infinity: a logprob below this is sent as this (vLLM's floor).
LOGPROB_FLOOR = -9999.0


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: PromptLogprob(logprob=clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in entry.items()
        }
        for entry in entries
    ]
