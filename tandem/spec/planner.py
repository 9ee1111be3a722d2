"""What the scheduler asks about speculation each step (draft lengths, n-gram proposals), and where
the engine hands back what the step cost and produced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tandem.core.draft_tree import DraftTree
from tandem.core.request import Request
from tandem.core.stats import EngineCounters, bump
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.spec.config import SpeculativeConfig
from tandem.spec.controller import AdaptiveSpeculation, Plan
from tandem.spec.suffix import SuffixSpeculator


class SpecPlanner:
    """Pure Python: the scheduler calls `plan`, `propose` and `observe` (acceptance); the engine
    calls `observe_step` once per step with its plan, timings and output."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_catch_up: int | None = None,
        counters: EngineCounters | None = None,
    ) -> None:
        self.config = config
        # The most catch-up one request may feed its draft in a step (the engine passes its step
        # token budget, which bounds a prompt chunk of the target's too); None: unbounded.
        self.max_catch_up = max_catch_up
        # Draft model: tokens each request's draft has been fed (mirrors the runner's drafter, which
        # feeds num_tokens - 1 + k positions per proposal). After a preemption the mirror can
        # overstate it (the drafter starts over); it only sizes the catch-up budget, and what is
        # emitted never depends on it.
        self._fed: dict[str, int] = {}
        self.suffix = SuffixSpeculator(config.suffix) if config.method == "suffix" else None
        self.controller = AdaptiveSpeculation(
            config.num_speculative_tokens,
            adaptive=config.adaptive,
            config=config.adaptive_config,
            passes_for=self._passes_for,
        )
        # Suffix speculation under the controller: this step's proposals, looked up to price them
        # (`_lookups`) and handed out truncated by `propose`; and per request, the probabilities
        # of the tokens it was last given (`observe` files how many of those were accepted).
        self._proposals: dict[str, tuple[list[int] | DraftTree, list[float]]] = {}
        self._given: dict[str, list[float]] = {}
        # Pure-decode steps still to come that are no samples (`AdaptiveConfig.cold_steps`).
        self._cold_left = config.adaptive_config.cold_steps
        # The engine's counters (tandem/core/stats.py): drafts and acceptance, per method too.
        self.counters = counters if counters is not None else EngineCounters()

    @property
    def proposes_in_runner(self) -> bool:
        """A draft model and draft heads propose in the runner, in timed passes the plan prices."""
        return self.config.method == "draft_model" or self.config.uses_head

    def _passes_for(self, k: int) -> int:
        """The runner's passes for a proposal of k tokens (worker/drafter.py, head_drafter.py)."""
        if self.config.method == "medusa":
            return 1
        if self.config.method == "eagle":
            return min(self.config.tree_depth, k)
        return k

    def leased(self, running: list[Request]) -> Plan | None:
        """The step's plan under the controller's lease (no drafts), asked first; None: `plan`."""
        ctl = self.controller
        if not ctl.lease_left:
            return None
        return ctl.leased((r.request_id for r in running), len(running))

    def plan(self, decoding: list[Request], other_tokens: int, max_model_len: int) -> Plan:
        """Draft length for each decoding request (capped where the request is about to end)."""
        backlog = (lambda: self._backlog(decoding)) if self.proposes_in_runner else None
        self._proposals.clear()
        suffix = self.suffix if self.config.adaptive_config.lookup_pricing else None
        lookup = (lambda: self._lookups(suffix, decoding)) if suffix is not None else None
        plan = self.controller.plan(
            [r.request_id for r in decoding], other_tokens, self.proposes_in_runner, backlog, lookup
        )
        if not plan.num_draft:  # nothing to cap (every step while speculation is off)
            return plan
        out = {}
        for r in decoding:
            # Drafts past max_tokens or max_model_len could never be kept.
            room = min(r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
            k = max(0, min(plan.num_draft.get(r.request_id, 0), room))
            if k:
                out[r.request_id] = k
        if self.proposes_in_runner and self.config.adaptive and out:
            out = self._cap_catch_up(decoding, out)
        return replace(plan, num_draft=out)

    def _behind(self, r: Request) -> int:
        """Tokens the request's draft must catch up on before proposing, beyond the one or two
        every proposal feeds."""
        if self.config.method == "medusa":  # reads the last feature only: never behind
            return 0
        fed = min(self._fed.get(r.request_id, 0), r.num_computed_tokens)
        return max(0, r.num_tokens - fed - 2)

    def _backlog(self, decoding: list[Request]) -> dict[str, float]:
        """Catch-up tokens per step over which drafting would pay them off: the request's remaining
        tokens (halved: a speculating step emits more than one), at most `feed_horizon_steps`."""
        horizon = self.config.adaptive_config.feed_horizon_steps
        out = {}
        for r in decoding:
            behind = self._behind(r)
            if behind:
                steps = min(horizon, (r.max_tokens - r.num_output_tokens) / 2)
                out[r.request_id] = behind / max(1.0, steps)
        return out

    def _cap_catch_up(self, decoding: list[Request], ks: dict[str, int]) -> dict[str, int]:
        """Drop drafts of requests whose draft would first have to catch up on more than the step's
        catch-up budget allows (the closest to caught up go first; the rest catch up in later
        steps). Without a cap, switching speculation on at high concurrency would cost a draft
        prefill of every running request in one step, which the gate then (rightly) measures as a
        very slow "on" step. Only the adaptive mode caps: a fixed `k` always drafts.

        The closest one is kept even over the budget, up to `max_catch_up`: a draft catches up only
        by drafting, so a request further behind than the budget would otherwise never draft again
        (one whose prompt alone exceeds it, never at all). `max_catch_up` bounds the latency that
        adds to the step for everyone in it; a request behind by more stays without drafts."""
        behind = [(self._behind(r), r.request_id) for r in decoding if r.request_id in ks]
        behind.sort()
        budget = self.config.adaptive_config.catch_up_tokens_per_step
        out: dict[str, int] = {}
        for extra, rid in behind:
            if extra <= budget or (not out and (self.max_catch_up is None or extra <= self.max_catch_up)):
                budget -= extra
                out[rid] = ks[rid]
        return out

    def _lookups(self, suffix: SuffixSpeculator, decoding: list[Request]) -> dict[str, Sequence[float]]:
        """Suffix proposals of the most tokens for the plan to price (`AdaptiveSpeculation.plan`'s
        `lookup`), kept for `propose`."""
        k = self.config.num_speculative_tokens
        for r in decoding:
            self._proposals[r.request_id] = suffix.scored(r, k)
        return {rid: probs for rid, (_, probs) in self._proposals.items()}

    def propose(self, req: Request, k: int) -> list[int] | DraftTree | None:
        """n-gram lookup and suffix speculation propose here (may find fewer than k; suffix a tree
        of at most k nodes); a draft model proposes in the runner."""
        looked = self._proposals.pop(req.request_id, None)
        if looked is not None:  # priced by the plan: its first k tokens are the proposal of k
            proposal, probs = looked
            self._given[req.request_id] = probs[:k]
            return proposal.prefix(k) if isinstance(proposal, DraftTree) else proposal[:k]
        if self.suffix is not None:
            return self.suffix.scored(req, k)[0]
        if self.config.method != "ngram":
            return None
        from tandem.spec.ngram import propose_ngram

        return propose_ngram(req.token_ids, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def observe(self, req: Request, num_draft: int, num_accepted: int) -> None:
        """A request's verified drafts, before its new tokens are appended."""
        if num_draft <= 0:
            return
        rid = req.request_id
        given = self._given.pop(rid, None)
        if given is not None:
            self.controller.observe_lookup(sum(given[:num_draft]), num_accepted)
        # A draft model has fed the k drafts; a head's KV, the known tokens (its tree rows are
        # scratch), and its next proposal feeds the accepted ones as a matter of course.
        self._fed[rid] = req.num_tokens - 1 + (num_accepted if self.config.uses_head else num_draft)
        self.controller.observe_acceptance(rid, num_draft, num_accepted)
        c, method = self.counters, self.config.method
        c.spec_decode_num_drafts += 1
        c.spec_decode_num_draft_tokens += num_draft
        c.spec_decode_num_accepted_tokens += num_accepted
        bump(c.spec_decode_num_draft_tokens_by_method, method, num_draft)
        bump(c.spec_decode_num_accepted_tokens_by_method, method, num_accepted)
        for i in range(num_accepted):
            bump(c.spec_decode_num_accepted_tokens_per_pos, str(i))
        bump(c.spec_decode_acceptance_length, num_accepted + 1)
        bump(c.spec_decode_tree_size, num_draft)

    def seed_costs(
        self, step_points: list[tuple[int, float]], draft_points: list[tuple[int, float]], feed_cost: float
    ) -> None:
        """Costs timed at load (`AdaptiveSpeculation.seed`)."""
        self.controller.seed(step_points, draft_points, feed_cost)

    def observe_step(
        self,
        sched: SchedulerOutput,
        result: RunnerOutput,
        generated: int,
        seconds: float,
        update_seconds: float,
    ) -> None:
        """A step's feedback: `generated` output tokens in `seconds` of wall time; the step-cost line
        learns from `update_seconds`, the part up to the end of the scheduler's update (before the
        outputs are built).

        Only pure-decode steps, in which each request computed exactly its next token plus its
        drafts, are samples of what speculation decides: a mode's rate for the gate, and the
        step-cost line, which a prompt's many cheap-per-token rows would skew. Draft catch-up
        (`observe_draft_pass`) is split out of the step: tokens missed while speculation was off
        are the price of switching on, paid once, which the gate charges to how often it explores
        (else every exploration would pay it and look worse than speculation running); a new
        request's prompt is fed whenever speculation runs, so the "on" rate pays for it."""
        ctl = self.controller
        if getattr(sched.spec_plan, "leased", False) and not result.draft_passes:
            # A leased plan's step is no sample (AdaptiveSpeculation.leased); nor, if it computed
            # prompt tokens too, a step the gate counts.
            if sched.total_tokens != len(sched.requests):
                ctl.not_a_gate_step()
            return
        pure = all(
            n == 1 + sched.num_draft.get(r.request_id, 0) for r, n in zip(sched.requests, sched.num_tokens)
        )
        # A step planned by no SpecPlanner (none was asked) is no sample of either mode.
        plan = sched.spec_plan if isinstance(sched.spec_plan, Plan) else Plan({})
        # A step in which nothing was verified is an "off" sample, also where the plan gave drafts
        # that a lookup (n-gram, suffix) then did not find; `empty_lookups_on` files those as "on"
        # (they paid the lookups).
        drafted = any(sched.num_draft.values()) or (
            self.config.adaptive_config.empty_lookups_on and any(plan.num_draft.values())
        )
        # An engine's first steps pay one-time costs: no sample of the gate's rates or of the step
        # cost's scale. The overhead and draft-pass lines still learn (a sample is capped and the
        # overhead shrunk toward none while it has few), so a method that does not pay stops
        # drafting after one or two steps instead of drafting through them all.
        cold = self._cold_left > 0
        if cold:
            self._cold_left -= pure
        if pure and (not cold or (drafted and ctl.seeded)):
            ctl.observe_step(
                sched.total_tokens,
                update_seconds - result.draft_time,
                drafted=drafted,
                draft_tokens=sum(sched.num_draft.values()),
            )
        switch = feed = 0.0
        for p in result.draft_passes:
            s, f = ctl.observe_draft_pass(p)
            switch += s
            feed += f
        if cold:
            return
        ctl.observe_outcome(
            plan,
            generated,
            seconds - switch,
            drafted=drafted,
            pure=pure,
            switch_seconds=switch,
            feed_seconds=feed,
        )

    def forget(self, request_id: str) -> None:
        self.controller.forget(request_id)
        self._given.pop(request_id, None)
        self._fed.pop(request_id, None)
        if self.suffix is not None:  # its output joins what later requests' drafts are drawn from
            self.suffix.forget(request_id)
