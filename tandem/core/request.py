"""Request state as the scheduler sees it: token counts, blocks, status, timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    # The engine failed to compute this request (a fault attributed to it alone); others go on.
    FINISHED_ERROR = 6
    # Held out of scheduling with its blocks kept: its KV is being handed to another instance.
    PAUSED = 7
    # Preempted by swap: waiting with its computed KV kept, in host blocks (`Request.host_block_ids`)
    # plus the leading device blocks other requests hold too; swapped in, it goes on where it was.
    SWAPPED = 8

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# The stop_reason of a sample whose constraints (allowed_token_ids, bad_words, its grammar) left no
# token to choose at its next position: it ends there, finish_reason "stop".
NO_ALLOWED_TOKEN = "no_allowed_token"

# Overlap scheduling: the value in `Request.token_ids` of an output token sampled on the device but
# not yet read back to the host (the runner feeds the real one from the device; never a vocabulary id).
PLACEHOLDER = -1

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)  # identity equality: the scheduler removes requests from lists
class Request:
    """One sequence being generated.

    The scheduler's whole job is to close the gap between `num_computed_tokens`
    (KV written and valid) and `num_tokens` (prompt plus sampled tokens).
    A request with `n > 1` is a leader with `n - 1` pending children: the leader
    computes the prompt once and the children fork off its blocks when the
    first tokens are sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    # The user's request id and this sample's index in it (n > 1).
    group_id: str = ""
    sample_index: int = 0
    seed: int | None = None

    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # While SWAPPED: the host (swap space) blocks holding its block table from `len(block_ids)` on.
    host_block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    pending_children: list[Request] = field(default_factory=list)

    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # Set on resumption after preemption: the request may not be chosen as a
    # victim again until it has sampled at least this many output tokens.
    protected_until_outputs: int = 0
    # The prefix-cache node whose path this request has locked (opaque to everything but the cache).
    prefix_node: object | None = None
    # With `sampling.prompt_logprobs`: the index of the next prompt token whose logprob is owed
    # (the first token has none). Survives preemption, so a recomputed prompt emits nothing twice.
    prompt_logprobs_next: int = 1
    # Overlap scheduling: output tokens at the end of `token_ids` that are still PLACEHOLDER (0 or 1:
    # the step that sampled it has been launched, not collected; `Scheduler.advance` / `resolve`).
    num_placeholders: int = 0

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def owes_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None and self.prompt_logprobs_next < len(self.prompt_token_ids)

    @property
    def num_seats(self) -> int:
        """Running-slots this request takes once admitted (itself plus pending forks)."""
        return 1 + len(self.pending_children)

    @property
    def protected(self) -> bool:
        return self.num_output_tokens < self.protected_until_outputs

    @property
    def is_finished(self) -> bool:
        return self.status.finished
