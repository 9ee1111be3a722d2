"""What crosses between the scheduler and the model runner each step: the step's plan
(`SchedulerOutput`) and what the runner sampled (`RunnerOutput`). What users get back is in
tandem/outputs.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.core.draft_tree import DraftTree
from tandem.core.request import Request


class SpecPlan(Protocol):
    """A step's speculation plan (tandem.spec.controller.Plan) as the scheduler reads it: the draft
    length per decoding request. The rest is the planner's, handed back to it with the step's feedback."""

    @property
    def num_draft(self) -> dict[str, int]: ...


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: which requests compute how many tokens, in batch order."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    # (src, dst) block copies to perform before the forward (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Preemption by swap: (device block, host block) copies out of the KV cache into the swap space,
    # and (host block, device block) copies back in. The runner performs, in this order, the swap-outs
    # (their device blocks may be reused in this very step), the copy-on-write copies (a source
    # may be a block freed this step and handed to a swap-in), then the swap-ins.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that ended since the previous step; the runner drops their state.
    finished_ids: list[str] = field(default_factory=list)
    # Speculation: draft tokens per request, included in `num_tokens` (1 + k for a decoding request).
    num_draft: dict[str, int] = field(default_factory=dict)
    # Draft tokens already proposed by the scheduler (n-gram, suffix); a draft model proposes in the
    # runner. A request whose drafts form a tree (not a chain) also has it here, its nodes in order
    # in `draft_tokens` (tandem/core/draft_tree.py).
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)
    draft_trees: dict[str, DraftTree] = field(default_factory=dict)
    # The plan the drafts came from, for the speculation planner's feedback after the step.
    spec_plan: SpecPlan | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class SampledLogprobs:
    """Logprobs of one sampled token: its own, its rank, and the top-k alternatives."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class DraftPass:
    """One draft-model proposal pass, as the adaptive controller's cost model sees it."""

    num_requests: int
    seconds: float
    # Tokens the pass fed to catch drafts up, beyond the one or two every proposal feeds...
    catch_up_tokens: int = 0
    # ...of which generated while speculation was off (the rest are new requests' prompts).
    missed_tokens: int = 0


@dataclass(slots=True)
class RunnerOutput:
    """Tokens sampled this step, keyed by request id (forked children included).

    A speculating request emits its accepted draft tokens, then `sampled` (the
    target's bonus or recovered token). `logprobs` has one entry per emitted token.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list[SampledLogprobs]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    draft_passes: list[DraftPass] = field(default_factory=list)
    # Requests owed prompt logprobs: the index of the first prompt token covered this step, and one
    # entry per token from there (tandem/worker/prompt_logprobs.py).
    prompt_logprobs: dict[str, tuple[int, list[SampledLogprobs]]] = field(default_factory=dict)
    # Requests whose constraints (allowed_token_ids, bad_words, a grammar) left no token to choose
    # at their next position: they end after their accepted drafts, without `sampled`.
    dead_ends: set[str] = field(default_factory=set)
    # Seconds in the target model itself (layers and logits), to tell engine overhead from compute.
    forward_time: float = 0.0

    @property
    def draft_time(self) -> float:
        """Seconds in draft-model proposal passes."""
        return sum(p.seconds for p in self.draft_passes)
