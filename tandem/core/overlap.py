"""Overlap scheduling: which steps may run ahead of the host, and which must not.

In overlap mode (`async_scheduling`) the engine launches step N+1 before it reads step N's tokens
back: each running request's next input is a placeholder the runner fills on the device from step
N's sampled tokens. That holds only while nothing needs a step's tokens on the host before the
next step is planned or launched. A step for which `sync_reason` names a reason runs the
synchronous way instead: the step in flight is collected first, then this one is launched and
collected before the next is scheduled (tandem/engine/core.py).
"""

from __future__ import annotations

from dataclasses import replace

from tandem.core.request import Request
from tandem.core.step_io import SchedulerOutput

# Why a step runs synchronously (the engine counts each, `overlap_sync_steps`, and the tests read them).
SPECULATION = "speculation"
PREEMPTION = "preemption"
FORK = "fork"
PROMPT_LOGPROBS = "prompt_logprobs"
HOST_TOKENS = "host_tokens"
EMPTY = "empty"
# Not a property of the plan: the launch raised (the engine runs the step synchronously to find
# the failing request).
FAULT = "fault"


def needs_host_tokens(req: Request) -> bool:
    """A request whose step reads its tokens on the host: a grammar walks its matcher over them,
    penalties count them, bad_words reads the output's tail; allowed_token_ids and bad_words masks
    (and the grammar's) are checked for dead rows with a read. (Logprobs are not: they are copied
    back beside the tokens.)"""
    sp = req.sampling
    return (
        sp.structured_outputs is not None
        or sp.uses_penalties
        or bool(sp.bad_words_token_ids)
        or sp.allowed_token_ids is not None
    )


def sync_reason(sched: SchedulerOutput) -> str | None:
    """Why this step must run synchronously, or None if it may be launched ahead of the host."""
    if sched.is_empty:
        return EMPTY
    if sched.num_draft or sched.draft_tokens or sched.draft_trees:
        return SPECULATION
    # Swap copies and victims whose in-flight token is still a placeholder: the victim's token
    # must be on the host before it is readmitted or its KV is moved.
    if sched.preempted or sched.swap_in or sched.swap_out:
        return PREEMPTION
    for req in sched.requests:
        if req.pending_children:
            return FORK  # the children join the batch only once the leader's first token is known
        if req.owes_prompt_logprobs:
            return PROMPT_LOGPROBS
        if needs_host_tokens(req):
            return HOST_TOKENS
    return None


def without_finished(sched: SchedulerOutput) -> SchedulerOutput:
    """The plan less the requests that ended after it was made (their token from the step in flight
    stopped them): a step run synchronously after collecting that one computes nothing for them."""
    if not any(r.is_finished for r in sched.requests):
        return sched
    keep = [i for i, r in enumerate(sched.requests) if not r.is_finished]
    return replace(
        sched,
        requests=[sched.requests[i] for i in keep],
        num_tokens=[sched.num_tokens[i] for i in keep],
    )
