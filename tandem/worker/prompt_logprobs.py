"""Logprobs of prompt tokens, taken from a prefill pass's hidden states.

Only requests whose `SamplingParams.prompt_logprobs` is set pay for this: their prompt positions get
full-vocabulary logits, every other row of the step stays as cheap as before (logits only where a
token is sampled). Position p's logits give the logprob of prompt token p + 1, so a prompt chunk
covering positions [s, s + n) yields the logprobs of tokens s + 1 .. s + n (the last prompt position's
logits are the ones the first output token is sampled from). Each request says which token it is
owed next (`Request.prompt_logprobs_next`), so a prompt computed again after preemption emits nothing
twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.request import Request
from tandem.core.step_io import SampledLogprobs
from tandem.worker.sampler import Sampler

# Full-vocabulary logits rows held at once (a long prompt goes through in slices of this many):
# bounds the memory a prompt-logprobs request adds to a step (rows x vocabulary x 4 bytes).
PROMPT_LOGPROBS_ROWS = 256


@dataclass(slots=True)
class PromptSlice:
    """One request's prompt tokens whose logprobs this step computes."""

    request: Request
    first_token: int  # index in the prompt of the first token
    first_row: int  # its predecessor's row in the flat batch
    count: int


def plan(reqs: list[Request], num_tokens: list[int], ends: np.ndarray) -> list[PromptSlice]:
    """The prompt tokens each request of the step is owed logprobs for, and where their logits are."""
    out = []
    for i, req in enumerate(reqs):
        if not req.owes_prompt_logprobs:
            continue
        start, n = req.num_computed_tokens, num_tokens[i]
        lo = max(start + 1, req.prompt_logprobs_next)
        hi = min(start + n, req.num_prompt_tokens - 1)  # inclusive
        if lo > hi:
            continue
        first_row = int(ends[i]) - n + (lo - 1 - start)
        out.append(PromptSlice(req, lo, first_row, hi - lo + 1))
    return out


def compute(
    slices: list[PromptSlice], hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, tuple[int, list[SampledLogprobs]]]:
    """Per request id: the index of its first prompt token covered and the logprobs of each
    (the token's own, its rank, and the request's top-k), from the raw model distribution."""
    out: dict[str, tuple[int, list[SampledLogprobs]]] = {}
    for sl in slices:
        req = sl.request
        k = req.sampling.prompt_logprobs
        targets = req.prompt_token_ids[sl.first_token : sl.first_token + sl.count]
        lps: list[SampledLogprobs] = []
        for off in range(0, sl.count, PROMPT_LOGPROBS_ROWS):
            m = min(PROMPT_LOGPROBS_ROWS, sl.count - off)
            rows = hidden[sl.first_row + off : sl.first_row + off + m]
            raw = torch.log_softmax(compute_logits(rows).float(), dim=-1)
            tokens = torch.tensor(targets[off : off + m], dtype=torch.long, device=raw.device)
            lps += [lp for lp in Sampler.logprobs(raw, tokens, [k] * m) if lp is not None]
        out[req.request_id] = (sl.first_token, lps)
    return out
