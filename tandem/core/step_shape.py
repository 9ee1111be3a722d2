"""What one engine step computes, as the scheduler planned it: the features step-time models are
fitted on (tandem/sim/cost.py) and the engine's step trace records (tandem/engine/step_trace.py).
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.step_io import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes, as the scheduler planned it."""

    # tokens of requests still in their prompt (a chunk each)
    prefill_tokens: int
    # requests computing exactly one new token
    decode_rows: int
    # sum over the step's requests of their KV length after the step (what attention reads)
    context_tokens: int
    # rows of the batch (prefill chunks + decodes)
    num_requests: int
    draft_tokens: int = 0  # speculative tokens verified (0 without speculation)
    # (Added to the planned interface.) The (query, key) pairs causal attention scores, summed over
    # the step's requests: a query of q tokens after p computed ones scores q * p + q * (q + 1) / 2
    # pairs (each new token sees the context and the new tokens up to itself). It is what makes a
    # long prompt's attention grow with the square of its length; for a decode row it equals the
    # row's context. 0 means not known: models then take `context_tokens` in its place.
    attention_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Query tokens through the layers: every row's new tokens and the drafts it verifies."""
        return self.prefill_tokens + self.decode_rows + self.draft_tokens

    @property
    def attention_pairs(self) -> int:
        """`attention_tokens`, or its lower bound `context_tokens` when the shape does not say."""
        return max(self.attention_tokens, self.context_tokens)


def shape_of(sched: SchedulerOutput) -> StepShape:
    """The shape of a step as `Scheduler.schedule` planned it; call before `Scheduler.update`, which
    advances the requests' computed counts this reads.

    A request whose own query is one token (with or without drafts) is a decode row, whatever got it
    there (a prompt's last one-token chunk computes the same as a decode); any longer query is a
    prefill chunk (a prompt, or the recompute of a preempted request)."""
    prefill = decode = context = drafts = attention = 0
    for req, n in zip(sched.requests, sched.num_tokens):
        k = sched.num_draft.get(req.request_id, 0)
        kv_len = req.num_computed_tokens + n
        if n - k == 1:
            decode += 1
        else:
            prefill += n - k
        drafts += k
        context += kv_len
        attention += n * req.num_computed_tokens + n * (n + 1) // 2
    return StepShape(
        prefill_tokens=prefill,
        decode_rows=decode,
        context_tokens=context,
        num_requests=len(sched.requests),
        draft_tokens=drafts,
        attention_tokens=attention,
    )
