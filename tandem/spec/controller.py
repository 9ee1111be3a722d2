"""Adaptive speculation: how many draft tokens each request gets this step (0 included).

Each request's drafts are priced by a step-cost model (`LinearCost` lines timed at load and rescaled
online) against its own acceptance history, so speculation turns itself down, to zero, where
verification costs more than it returns; a measured gate (`SpecGate`) on top runs speculation only
where it has been measured to pay. docs/speculative_decoding.md explains the model, the gate and
the measurements behind `AdaptiveConfig`'s defaults.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.core.step_io import DraftPass
from tandem.spec.config import AdaptiveConfig
from tandem.spec.cost import LinearCost
from tandem.spec.gate import SpecGate


@dataclass(frozen=True, slots=True)
class Plan:
    """A step's draft lengths, and the gate's mode for the step: the step's outcome, handed back to
    `observe_outcome` with the plan, is filed under that mode."""

    num_draft: dict[str, int]
    # Requests decoding when the plan was made (the gate's batch-size bucket).
    num_decoding: int = 0
    # The gate's mode for a pure-decode step of an adaptive plan; None: the step is no gate sample.
    gate_on: bool | None = None
    # False: the next plan is held at zero drafts unless the gate's choice or the batch-size bucket
    # changes or a request joins first (see `AdaptiveSpeculation.plan`, which then drafts nothing
    # in that plan either), so a drafter whose proposal reads only the previous step's features
    # (Medusa) need not store this step's (`HeadDrafter.keeps_features`).
    drafts_next: bool = True
    # Handed out under a lease (see `AdaptiveSpeculation.leased`): the gate was not asked, and the
    # step is no sample of anything (`SpecPlanner.observe_step` files nothing for it).
    leased: bool = False


class AdaptiveSpeculation:
    """Plans draft lengths per step and learns, from each step's feedback, what speculation costs and
    how often each request's drafts are accepted."""

    def __init__(
        self,
        max_k: int,
        adaptive: bool = True,
        config: AdaptiveConfig | None = None,
        passes_for: Callable[[int], int] | None = None,
    ) -> None:
        self.config = cfg = config or AdaptiveConfig()
        self.max_k = max_k
        self.adaptive = adaptive
        # Draft passes a proposal of k tokens (a chain, or a tree of k nodes) takes, for a method
        # that drafts in passes the plan prices (`draft_passes_cost`): a draft model's k (one per
        # token), EAGLE's min(tree_depth, k) (one per depth), Medusa's 1. None: k.
        self.passes_for = passes_for or (lambda k: k)
        self.step_cost = LinearCost(cfg.cost_decay)
        self.draft_cost = LinearCost(cfg.cost_decay)
        self._acc: dict[str, tuple[float, float]] = {}
        # Per request, (accepted, rejected) draft tokens among those following an accepted one
        # (`continuation`): decayed and faded as `_acc`.
        self._run: dict[str, tuple[float, float]] = {}
        self.gate = SpecGate(cfg)
        # Seconds a step that drafts costs beyond T(t) and its draft passes, a line in the step's draft
        # tokens (learned; see observe_step): verification can cost more per token than T's slope
        # (a slow path past some rows), so small drafts may pay where large ones do not.
        self.overhead = LinearCost(cfg.overhead_decay)
        # Plans since the last pricing that could have drafted and did not: the overhead fade the
        # next pricing applies (`overhead_fade`).
        self._idle = 0
        # Seconds per token a draft model takes to catch up (timed at load, learned online), and the
        # running mean of prompt catch-up per drafting step (see observe_outcome).
        self.feed_cost = 0.0
        self.feed_mean = 0.0
        # A zero-drafts verdict held without pricing (see `plan`): the (bucket, exploring) it was
        # priced for, the plans it still covers, the hold's length, and the plans held since the
        # last pricing (whose history fade the next pricing applies).
        self._hold_key: tuple[int, bool] | None = None
        self._hold_ids: frozenset[str] = frozenset()
        self._hold_left = 0
        self._hold_len = 0
        self._held = 0
        # A lease (see `leased`): the batch size it was made for and its bucket, the plans it
        # still covers (public: the scheduler asks it first each step), the plans
        # handed out under it since the gate last counted steps, and whether it is a held zero
        # verdict (`_hold_*`) or the gate's "off".
        self._lease_n = 0
        self._lease_bucket = 0
        self.lease_left = 0
        self._lease_used = 0
        self._lease_hold = False
        self._lease_plans: tuple[Plan, ...] = ()
        # Whether the last plan let its step's features be stored (its `drafts_next`).
        self._stored = True
        # Plans priced (tests count them: a held plan is not priced).
        self.num_priced = 0
        # Accepted and expected draft tokens of lookup-priced proposals (`observe_lookup`),
        # history-decayed: how well the lookup's probabilities predict acceptance.
        self._lookup_accepted = 0.0
        self._lookup_expected = 0.0

    # -- estimates -------------------------------------------------------

    def _posterior(self, request_id: str) -> tuple[float, float]:
        """The mean of the request's Beta posterior on per-token acceptance, and its pseudo-count."""
        a, r = self._acc.get(request_id, (0.0, 0.0))
        pa, pr = self.config.prior_accepted, self.config.prior_rejected
        n = a + r + pa + pr
        return (a + pa) / n, n

    def optimistic_alpha(self, request_id: str) -> float:
        """The acceptance the plan prices a request's drafts at: the posterior mean plus `explore_z`
        standard deviations. With little evidence (a new request, or an old one whose history has
        faded) it is high, so the request drafts and its acceptance gets measured; with much, it is
        close to the mean. Priced at the mean, a new request whose prior makes drafting only break
        even would never draft, so never learn that it pays."""
        mean, n = self._posterior(request_id)
        return min(1.0, mean + self.config.explore_z * math.sqrt(mean * (1.0 - mean) / (n + 1.0)))

    def continuation(self, request_id: str, alpha: float) -> float:
        """The acceptance the plan prices a draft token at once the token before it was accepted.
        Drafts that copy (a file re-emitted, a repeated answer) are accepted in runs: past the
        first few tokens, the next is far likelier accepted than the first was, and a geometric
        model in the per-token rate alone (alpha ** depth) would cut every run short. The
        request's own runs decide, shrunk toward `alpha` (what the i.i.d. model says) with the
        prior's pseudo-count, so without evidence nothing changes."""
        s, f = self._run.get(request_id, (0.0, 0.0))
        n0 = self.config.prior_accepted + self.config.prior_rejected
        return (s + alpha * n0) / (s + f + n0)

    def observe_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        rejected = 1.0 if num_accepted < num_draft else 0.0
        d = self.config.history_decay
        a, r = self._acc.get(request_id, (0.0, 0.0))
        self._acc[request_id] = (d * a + num_accepted, d * r + rejected)
        if num_accepted:  # the tokens after the first accepted one: a run, and how it ended
            s, f = self._run.get(request_id, (0.0, 0.0))
            self._run[request_id] = (d * s + num_accepted - 1, d * f + rejected)

    @property
    def lookup_calibration(self) -> float:
        """Accepted per expected draft token of lookup-priced proposals, shrunk toward 1."""
        prior = self.config.lookup_prior_tokens
        return (self._lookup_accepted + prior) / (self._lookup_expected + prior)

    def observe_lookup(self, expected: float, accepted: int) -> None:
        """A verified proposal the lookup expected `expected` accepted tokens of (its verified
        tokens' probabilities summed), of which `accepted` were."""
        d = self.config.history_decay
        self._lookup_accepted = d * self._lookup_accepted + accepted
        self._lookup_expected = d * self._lookup_expected + expected

    def _fade_history(self, request_id: str, factor: float) -> None:
        """A request's acceptance evidence weighs `factor` of what it did (toward the prior)."""
        for hist in (self._acc, self._run):
            if request_id in hist:
                a, r = hist[request_id]
                hist[request_id] = (a * factor, r * factor)

    @property
    def spec_overhead(self) -> float:
        """Seconds a drafting step costs beyond the step-cost line before any draft token (the
        overhead line's intercept; `overhead` also has a slope per draft token)."""
        return self.overhead_coefficients()[0]

    def overhead_coefficients(self) -> tuple[float, float]:
        """The overhead line as priced: its fit, shrunk toward no overhead while it rests on few
        samples (`overhead_prior_samples`)."""
        o0, o1 = self.overhead.coefficients()
        count, prior = self.overhead.count, self.config.overhead_prior_samples
        if not prior or not count:
            return o0, o1
        w = count / (count + prior)
        return w * o0, w * o1

    def observe_step(
        self, num_tokens: int, seconds: float, drafted: bool = False, draft_tokens: int = 0
    ) -> None:
        """A pure-decode step's seconds (draft passes excluded), `draft_tokens` of its `num_tokens`
        verified drafts. With a measured shape, steps that drafted only teach `overhead`, what
        speculating adds beyond the shape's tokens (proposals, verification, rewinds: Python per
        step), and the rest rescale the shape."""
        if drafted and self.step_cost.shape is not None:
            # A sample counts at most twice the line's prediction plus a step's cost: a step
            # stretched by a one-time cost (a collection pause, a request's first tree) once set
            # the overhead to several steps, so no plan drafted and nothing measured it again
            # until it faded. A true overhead that large is still learned, the cap growing with
            # the line, and drafting stops as soon as the line reaches what drafting gains.
            step = self.step_cost.predict(num_tokens)
            excess = min(seconds - step, 2.0 * max(0.0, self.overhead.predict(draft_tokens)) + step)
            self.overhead.observe(draft_tokens, excess)
        else:
            self.step_cost.observe(num_tokens, seconds)

    def observe_draft_pass(self, p: DraftPass) -> tuple[float, float]:
        """A draft-model proposal pass. A plain one teaches the draft-pass cost line. One that also
        caught drafts up teaches the catch-up cost per token, and returns what it took beyond a
        plain pass split as (switching, prompt) seconds, in proportion to the tokens missed while
        speculation was off and the new requests' prompt tokens (see `observe_outcome`)."""
        if not p.catch_up_tokens:
            self.draft_cost.observe(p.num_requests, p.seconds)
            return 0.0, 0.0
        excess = max(0.0, p.seconds - self.draft_cost.predict(p.num_requests))
        self.observe_feed(p.catch_up_tokens, excess)
        behind, missed = p.catch_up_tokens, p.missed_tokens
        return excess * missed / behind, excess * (behind - missed) / behind

    def observe_feed(self, tokens: int, seconds: float) -> None:
        """A draft pass's catch-up: `tokens` fed beyond a proposal's own, taking `seconds` more than
        a plain pass."""
        if tokens > 0:
            per_token = seconds / tokens
            d = self.config.feed_decay
            self.feed_cost = per_token if self.feed_cost == 0.0 else d * self.feed_cost + (1 - d) * per_token

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)
        self._run.pop(request_id, None)

    def seed(
        self,
        step_points: list[tuple[int, float]],
        draft_points: list[tuple[int, float]],
        feed_cost: float = 0.0,
    ) -> None:
        """Costs measured before the first step, `(tokens, seconds)` of steps and `(requests, seconds)`
        of draft passes: the plan is priced from the first step instead of drafting `max_k` blindly
        for `warmup_steps` steps (which, for a draft model, is exploring at full price). The fits
        give the costs' shapes; online samples scale them (`LinearCost.set_shape`)."""
        self.step_cost.set_shape(step_points)
        if draft_points:
            self.draft_cost.set_shape(draft_points)
        self.feed_cost = feed_cost

    @property
    def seeded(self) -> bool:
        """Whether the step cost was measured at load (`seed`)."""
        return self.step_cost.shape is not None

    def observe_outcome(
        self,
        plan: Plan,
        tokens: int,
        seconds: float,
        drafted: bool = True,
        pure: bool = True,
        switch_seconds: float = 0.0,
        feed_seconds: float = 0.0,
    ) -> None:
        """Output tokens and wall time of the step `plan` was made for, filed under the gate's mode.

        `drafted`: whether any request drafted (with `empty_lookups_on`, also one given drafts that
        its lookup did not find). An "on" step in which none did ran exactly as an "off" step, and
        counts as one: a mode that often drafts nothing cannot look like speculation that does not
        pay.

        `pure`: whether the step computed nothing but each decoding request's next token and its
        drafts. A step that also computed prompt tokens (a request admitted after the plan) is no
        sample of either mode: its time is mostly the prompt's.

        With a seeded step cost, the seconds are divided by its current scale (how much slower than
        at load the machine now runs steps): the gate's modes are measured at different moments,
        and the machine's speed drift would otherwise decide between them as much as speculation does.

        `switch_seconds`: what the step spent on draft catch-up (not in `seconds`): a cost of
        switching speculation on, which the gate charges to exploring "on" instead of to its rate.

        `feed_seconds`: what the step (in `seconds`) spent feeding new requests' prompts to a draft
        model, a cost of speculating at all. The "on" rate pays its running mean per drafting step
        instead of this step's: paid in the one step a request arrives, a prompt's catch-up (a few
        steps' worth at one request) would swing that step's sample, and the gate with it.
        """
        if switch_seconds > 0 and seconds > 0:
            self.gate.observe_switch(switch_seconds / seconds)
        if plan.gate_on is None or not pure:
            return
        on = plan.gate_on and drafted
        if on:
            d = self.config.feed_decay
            self.feed_mean = d * self.feed_mean + (1 - d) * feed_seconds
            seconds += self.feed_mean - feed_seconds
        self.gate.observe(plan.num_decoding, on, tokens, seconds / self.step_cost.scale)

    # -- the plan --------------------------------------------------------

    def plan(
        self,
        request_ids: list[str],
        other_tokens: int,
        draft_passes_cost: bool,
        backlog: Callable[[], dict[str, float]] | None = None,
        lookup: Callable[[], dict[str, Sequence[float]]] | None = None,
    ) -> Plan:
        """Draft length per decoding request; `other_tokens` are the step's non-speculative tokens.

        `lookup` (called only when the plan is priced; suffix speculation): per request, the
        probability of each token of the lookup's proposal in its order, non-increasing. The
        request's tokens are priced at those times `lookup_calibration` instead of from its
        acceptance history, which cannot see where a copy starts or how a tree branches: a chain
        model of acceptance priced a 32-node tree that copies at a few nodes. Such a plan is not
        held at zero drafts (the next step's lookup may find a match the hold would not look for).

        `backlog` (called only when the plan is priced): per request, the tokens a draft model must
        first catch up on (a new request's prompt, or what it missed while speculation was off) per
        step of the request's remaining life; each costs `feed_cost` once the request drafts, the
        catch-up paid off over those steps (so it keeps a request from starting to draft only where
        drafting barely pays)."""
        self.lease_left = 0  # a plan not handed out under the lease (`leased`) ends it
        self._settle_lease()
        # Every plan but a held one lets its step store features; whether the last one did.
        primed, self._stored = self._stored, True
        if not request_ids:
            return Plan({})
        if not self.adaptive:
            return Plan(dict.fromkeys(request_ids, self.max_k))
        if other_tokens:
            # A step that carries prompt chunks does not speculate: its cost is mostly the chunks,
            # the gate cannot measure it against anything, and verification tokens there cost
            # their full share.
            return Plan({})
        n = len(request_ids)
        choice = self.gate.choose(n)
        if not choice.on:
            self._hold_key = None
            # The overhead fades here too: the gate's next exploration of "on" is priced with it,
            # and an overhead gone stale while "off" would price that exploration at zero drafts,
            # so "on" would be neither run nor measured again. The gate, not the overhead, is what
            # keeps speculation off where it was measured not to pay.
            self._idle += 1
            self._lease(n, False, self.gate.repeats(n, choice), hold=False)
            # Features stored now serve a draft only where no lease covers the next plan.
            self._stored = self.lease_left == 0
            return Plan({}, n, gate_on=False, drafts_next=self._stored)
        if not self.seeded and self.step_cost.count < self.config.warmup_steps:
            if not primed:  # what a proposal would read was not stored: draft from the next plan
                return Plan(dict.fromkeys(request_ids, 0), n, gate_on=True)
            return Plan(dict.fromkeys(request_ids, self.max_k), n, gate_on=True)
        # A method that does not pay here is priced at zero drafts step after step, and pricing
        # (per request, per step, in Python) is most of what it then costs beyond speculation off.
        # So a zero verdict holds for 1, 2, 4, ... plans in a row (`zero_plan_hold_max`) while the
        # gate's choice and bucket stay and no request joins (a new one is priced at the prior's
        # optimistic acceptance): what else could turn it (costs drifting, histories fading
        # toward the prior) moves over tens of steps, not one.
        key = (SpecGate.bucket(n), choice.exploring)
        if self._hold_left > 0 and key == self._hold_key and self._hold_ids.issuperset(request_ids):
            self._hold_left -= 1
            self._held += 1
            self._idle += 1
            self._stored = self._hold_left == 0
            return Plan({}, n, gate_on=True, drafts_next=self._stored)
        self.num_priced += 1
        d = self.config.history_decay
        if self._held:
            # The fade each held plan would have applied (every request was given no drafts).
            fade = d**self._held
            for rid in request_ids:
                self._fade_history(rid, fade)
            self._held = 0
        if self._idle:
            # Nothing drafted since the overhead was last priced, so nothing measured it: fade it,
            # else one priced too high would stop every plan from drafting, and so from measuring
            # it again, for good.
            self.overhead.fade(self.config.overhead_fade**self._idle)
            self._idle = 0
        # While the gate explores "on" it has budgeted the catch-up that costs (`switch_steps`);
        # priced again here, it would stop the very drafts being measured, and the stale "on" rate
        # would stand.
        owed = backlog() if backlog is not None and not choice.exploring else {}
        probs = lookup() if lookup is not None else {}
        alphas = {}
        for rid in request_ids:
            if rid in probs:
                continue
            alpha = self.optimistic_alpha(rid)
            alphas[rid] = (alpha, self.continuation(rid, alpha))
        # A step that drafts at all pays fixed costs no single draft token pays for on its own: the
        # speculation overhead, and a draft model's passes (the same however few requests draft in
        # them). So each plan is priced with them paid up front, against not drafting: n-gram one
        # plan, a draft model one per pass count (1 pass first: later passes propose tokens less
        # likely to be accepted, so once one more pass does not pay, none does).
        k = dict.fromkeys(request_ids, 0)
        best = n / max(self.step_cost.predict(other_tokens + n), 1e-9)
        caps = range(1, self.max_k + 1) if draft_passes_cost else range(self.max_k, self.max_k + 1)
        for cap in caps:
            passes = self.passes_for(cap) if draft_passes_cost else 0
            # Exploring, or pass costs never measured (priced as free): a cheap proposal is what
            # gets measured, not the largest one.
            cheap = choice.exploring or self.draft_cost.count == 0
            if draft_passes_cost and cheap and passes > max(1, self.config.explore_max_passes):
                break
            plan_p, rate = self._allocate(request_ids, alphas, other_tokens, cap, passes, owed, probs)
            if rate <= best:
                break
            k, best = plan_p, rate
        # A request given no drafts produces no new acceptance evidence; let its history fade
        # toward the prior so one bad stretch does not shut it out for good.
        for rid, kr in k.items():
            if kr == 0:
                self._fade_history(rid, d)
        hold_max = self.config.zero_plan_hold_max
        drafts = any(k.values())
        if not drafts or not primed:
            self._idle += 1  # a plan that drafts nothing measures no overhead
        if not primed and drafts:
            # The hold ended early (a new bucket or gate choice) right after a plan that let its
            # step's features go unstored: what a proposal would read now is missing. Draft from
            # the next plan on, re-priced then.
            self._hold_key, self._hold_left, self._hold_len = None, 0, 0
            return Plan(dict.fromkeys(k, 0), n, gate_on=True)
        if hold_max and not drafts and lookup is None:
            self._hold_len = min(hold_max, 2 * self._hold_len if key == self._hold_key else 1)
            self._hold_key, self._hold_left = key, self._hold_len
            self._hold_ids = frozenset(request_ids)
            self._lease(n, True, min(self._hold_left, self.gate.repeats(n, choice)), hold=True)
        else:
            self._hold_key, self._hold_left, self._hold_len = None, 0, 0
        self._stored = self._hold_left == 0
        return Plan(k, n, gate_on=True, drafts_next=self._stored)

    def _lease(self, n: int, on: bool, plans: int, hold: bool) -> None:
        """Lease the plan just made (no drafts, gate mode `on`) for the next `plans` plans, at most
        `lease_max_steps`, while the bucket stays (and, for a held verdict, no request joins)."""
        self._lease_n, self._lease_bucket, self._lease_hold = n, SpecGate.bucket(n), hold
        self.lease_left = min(plans, self.config.lease_max_steps)
        if self.lease_left:
            self._lease_plans = tuple(Plan({}, n, gate_on=on, drafts_next=d, leased=True) for d in (False, True))

    def leased(self, request_ids: Iterable[str], count: int) -> Plan | None:
        """The next plan under the lease, if one holds for these `count` running requests: the
        same bucket, and for a held verdict none of them new. Asked before `plan`, with the
        running requests (those still in their prompt too: the step drafts nothing either way).

        A plan that drafts nothing, step after step, would still cost the gate's choice and the
        step's sample, in Python, each step: with a small model, a few percent of a step. So
        where the gate's choice cannot change for a while without a new sample (`repeats`:
        until its next exploration check), that verdict is leased for up to `lease_max_steps`
        plans, each handed out as it is: nothing asked, priced or sampled."""
        if not self.lease_left or not count or SpecGate.bucket(count) != self._lease_bucket:
            return None
        if self._lease_hold and not self._hold_ids.issuperset(request_ids):
            return None
        self.lease_left -= 1
        self._lease_used += 1
        self._idle += 1
        if self._lease_hold:
            self._hold_left -= 1
            self._held += 1
            self._stored = self._hold_left == 0
        else:
            self._stored = self.lease_left == 0
        return self._lease_plans[self._stored]

    def not_a_gate_step(self) -> None:
        """The step of the last leased plan computed prompt tokens too: a step the gate would not
        have been asked about (`plan` answers such steps without it), so not counted for it."""
        if self._lease_used:
            self._lease_used -= 1

    def _settle_lease(self) -> None:
        """Before the gate is asked again: the steps it was not asked about, counted."""
        if self._lease_used:
            self.gate.skip(self._lease_n, self._lease_used)
            self._lease_used = 0

    def _allocate(
        self,
        request_ids: list[str],
        alphas: dict[str, tuple[float, float]],
        other_tokens: int,
        cap: int,
        passes: int,
        backlog: dict[str, float],
        probs: dict[str, Sequence[float]] | None = None,
    ) -> tuple[dict[str, int], float]:
        """Greedy: give one more draft token (up to `cap` each) to the request whose next one is most
        likely accepted, while that raises the step's expected tokens per second. With `passes`
        draft-model passes, their fixed cost is paid from the start and each drafting request adds
        its share; so is the speculation overhead's fixed part, and each draft token adds its
        per-token part, and a request's first draft token its catch-up share (`backlog`). A request
        in `probs` has its j-th token accepted with probability probs[j] * `lookup_calibration`
        (no more tokens than it lists). Returns the draft lengths and the expected rate."""
        probs = probs or {}
        cal = self.lookup_calibration if probs else 1.0
        a, b = self.step_cost.coefficients()  # once, not per candidate token
        c, d = self.draft_cost.coefficients() if passes else (0.0, 0.0)
        o0, o1 = self.overhead_coefficients()
        a += max(0.0, o0)
        k = dict.fromkeys(request_ids, 0)
        expected = float(len(request_ids))
        tokens = base = other_tokens + len(request_ids)
        num_spec = 0
        feed = 0.0
        drafting = passes * (c + d)  # the passes' cost, one request in them (0 without passes)
        rate = expected / max(a + b * tokens + drafting, 1e-9)
        # A request's j-th draft token is accepted with probability alpha * beta ** (j - 1):
        # its first at the request's rate, each later one given the one before it (`continuation`).
        heap = [(-alphas[rid][0], rid) for rid in request_ids if rid in alphas]
        heap += [(-min(1.0, cal * probs[rid][0]), rid) for rid in request_ids if probs.get(rid)]
        heapq.heapify(heap)
        while heap:
            neg_gain, rid = heapq.heappop(heap)
            first = k[rid] == 0
            new_spec = num_spec + first
            new_feed = feed + self.feed_cost * backlog.get(rid, 0.0) if first else feed
            new_expected = expected - neg_gain
            new_drafting = passes * (c + d * new_spec)
            verify = b * (tokens + 1) + o1 * (tokens + 1 - base)
            new_rate = new_expected / max(a + verify + new_drafting + new_feed, 1e-9)
            if new_rate <= rate:
                continue  # this request's next draft token does not pay; others' might
            k[rid] += 1
            num_spec, feed, expected, tokens, rate = new_spec, new_feed, new_expected, tokens + 1, new_rate
            if k[rid] < cap:
                if rid in alphas:
                    alpha, beta = alphas[rid]
                    heapq.heappush(heap, (-(alpha * beta ** k[rid]), rid))
                elif k[rid] < len(probs[rid]):
                    heapq.heappush(heap, (-min(1.0, cal * probs[rid][k[rid]]), rid))
        return k, rate
