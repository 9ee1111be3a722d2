"""What crosses between the scheduler and the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: which requests compute how many tokens, in batch order."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    # (src, dst) block copies to perform before the forward (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that ended since the previous step; the runner drops their state.
    finished_ids: list[str] = field(default_factory=list)
    # Speculation: draft tokens per request, included in `num_tokens` (1 + k for a decoding request).
    num_draft: dict[str, int] = field(default_factory=dict)
    # Draft tokens already proposed by the scheduler (n-gram); a draft model proposes in the runner.
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token: its own, its rank, and the top-k alternatives."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    """Tokens sampled this step, keyed by request id (forked children included).

    A speculating request emits its accepted draft tokens, then `sampled` (the
    target's bonus or recovered token). `logprobs` has one entry per emitted token.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # (requests in the pass, seconds, tokens it fed to catch the draft up, how many of those were
    # generated while speculation was off) for each draft-model proposal pass, for the cost model.
    draft_pass_times: list[tuple[int, float, int, int]] = field(default_factory=list)
    # Seconds in the target model itself (layers and logits), to tell engine overhead from compute.
    forward_time: float = 0.0
