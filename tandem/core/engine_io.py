"""What goes into an engine core and comes out of it, as plain data: `EngineCoreRequest` (a
tokenized, validated request) and `SampleOutput` (what one sample gained in a step).

They live below both the engine and the KV plane (tandem/kvtransfer carries a request between
engines) so that neither needs the other's modules to name them; tandem/engine/messages.py
wraps them into the messages that cross the process boundary. `sample_request` makes the
scheduler's `Request` for one sample of an `EngineCoreRequest`: the one way a request is built,
by the engine core and by the cluster simulator alike."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.core.request import Request
from tandem.core.step_io import SampledLogprobs
from tandem.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreRequest:
    """A tokenized, validated request (one user request; the core fans out its `n` samples)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    # A request resumed on this engine after another ran part of it: per sample index, the tokens
    # it has already produced (None for a sample that has finished). The engine recomputes their
    # KV and goes on from there; they count as output (max_tokens, penalties, min_tokens).
    resumed_outputs: list[list[int] | None] | None = None
    # Which of the front end's runs of this request this is (a request moved or resumed elsewhere
    # is sent again with the next number); echoed in its outputs, so the front end can tell a run
    # it has left behind from the one it follows, even on the same instance.
    incarnation: int = 0


@dataclass(slots=True)
class SampleOutput:
    """What one sample of one request gained in a step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[SampledLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Filled when the sample finishes.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Set (with finish_reason "error") when the engine failed this request alone.
    error: str | None = None
    # The request's `incarnation`.
    incarnation: int = 0
    # Logprobs of prompt tokens computed this step (sample 0 only, with `prompt_logprobs` set): one
    # per token from the prompt's token `prompt_logprobs_start` on.
    prompt_logprobs: list[SampledLogprobs] | None = None
    prompt_logprobs_start: int = 0


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample 0 uses the request's seed; others get distinct streams derived from (seed, index)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_request(
    req: EngineCoreRequest,
    index: int = 0,
    outputs: list[int] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> Request:
    """The scheduler's Request for sample `index` of `req`, with `outputs` already produced."""
    params = req.params
    member = Request(
        request_id=req.request_id if index == 0 else f"{req.request_id}#{index}",
        prompt_token_ids=req.prompt_token_ids,
        sampling=params,
        max_tokens=req.max_tokens,
        eos_token_ids=tuple(eos_token_ids),
        arrival_time=req.arrival_time,
        priority=req.priority,
        tenant=req.tenant,
        cache_salt=req.cache_salt,
        group_id=req.request_id,
        sample_index=index,
        seed=sample_seed(params.seed, index),
        token_ids=[*req.prompt_token_ids, *outputs] if outputs else [],
    )
    if outputs or index > 0:
        # Prompt logprobs are the leader's, and a sample with output had its prompt's sent already.
        member.prompt_logprobs_next = len(req.prompt_token_ids)
    return member
