"""Adaptive speculation: how many draft tokens each request gets this step (0 included).

The model. A step that computes `t` tokens takes `T(t) = a + b*t` seconds.
A draft model adds `P` sequential proposal passes (the longest draft), each
`c + d*n` seconds for `n` drafting requests (zero for n-gram lookup). Both
lines are timed at load over synthetic batches (the engine seeds them) and
rescaled online by measured steps and passes (`LinearCost.set_shape`); without
a seed they are fitted online by exponentially weighted least squares. Request
`r` accepts each draft token with probability `alpha_r` (estimated from its own
history: accepted / (accepted + rejections), with a prior); with `k` drafts it
expects `1 + alpha + ... + alpha^k` tokens. The plan prices drafts at an optimistic
`alpha_r` (the posterior mean plus `explore_z` standard deviations), so a request
with little history drafts and gets measured: priced at the prior's mean, a new
request whose drafts only break even at 1/2 would never draft, so never learn
that they pay. Starting from `k = 0` everywhere,
the controller repeatedly gives one more draft token to the request whose next
token is most likely accepted (`alpha_r^(k_r+1)`) as long as that raises the
step's expected tokens per second, `sum_r E_r / (T(t) + o + P * (c + d*n))`, where
`o` is what a step that drafts at all costs beyond that (proposals, verification,
rewinds; learned from drafting steps' residuals). A draft model that must first
catch up on a request's tokens (its prompt, or what it missed while speculation
was off) adds, when that request starts drafting, the catch-up's cost (timed at
load per token) paid off over the request's remaining steps. `o` and, for a draft
model, the passes are paid up front, and the plan is kept only if it beats not drafting: one
token alone never pays for costs a whole batch's drafts share. A draft model's
pass count is fixed first (1, 2, ... up to `num_speculative_tokens`, while one
more pass still raises the best rate).

At low load the fixed cost `a` dominates, so extra tokens are nearly free and
requests get up to `num_speculative_tokens`; as the batch grows, `b*t`
dominates and a draft token is worth its cost only if it is very likely
accepted, so speculation turns itself down, to zero where it does not pay.

The model cannot see everything verification costs (draft passes, the extra
sampling rows, Python work per request), so a measured gate sits on top:
for each batch-size bucket (decoding requests, powers of two) it keeps the
measured output tokens per second of pure-decode steps with speculation on
(steps that verified drafts) and off (steps that did not, whatever the gate
chose: an "on" step whose plan or n-gram lookup drafted nothing ran as an
"off" one), exponentially weighted, runs the better mode, and now and then
spends a step on the other so both estimates stay current. How often follows
from what exploring costs: a step of the worse mode at relative rate `r < 1`
loses `1/r - 1` of a step, and switching a draft model on first feeds it what it
missed while off (`switch_steps`, measured), so the gate explores every
`(min_samples * (1/r - 1) + switch) / explore_cost` steps (clamped to [explore_every,
max_explore]) for `min_samples` consecutive steps, which keeps exploring below
`explore_cost` (1%) of the time; a burst, not a single step, because one
speculative step's output swings with acceptance, and a single lucky or
unlucky sample, weighted up by aging (below), would flip the verdict. A close call is
re-checked often; a clear loser rarely. The mode not being run also ages
with every step of the other (`stale_decay`), so a fresh exploration sample
outweighs old ones: acceptance drifts over a request's life, and comparing a
current rate with a stale one would keep the wrong mode. Steps that also carry prompt chunks
do not speculate at all: the gate cannot compare them, and measured, drafting in them cost
more than it returned. A bucket not yet
measured borrows the verdict of its neighbours, since speculation pays less
as the batch grows: "off" measured at a smaller batch means off here too, and
"on" measured at a larger batch means on; it then explores the other mode
on the slow schedule rather than starting with it. Speculation is therefore
on only where it has been measured to pay.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class LinearCost:
    """`y = a + b*x`, fitted by exponentially weighted least squares.

    With a shape measured up front (`set_shape`), online samples only rescale it: `y = s*(a0 + b0*x)`,
    `s` the decayed ratio of observed to shape-predicted costs. Online samples of a decoding batch
    barely vary `x` (a step of one request computes 1 to 1 + k tokens), and this machine's speed
    drifts 10-20% within seconds, so a slope fitted online from them is mostly noise (measured: 0.8
    ms per token at one request, against a true 0.01); the shape's slope comes from a wide range
    of `x` timed at load, and the scale tracks the machine and the engine's overhead."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.count = 0
        self.shape: tuple[float, float] | None = None
        self._observed = self._predicted = 0.0

    def set_shape(self, points: list[tuple[float, float]]) -> None:
        """The line through `points` (plain least squares) as the cost's shape."""
        fit = LinearCost(decay=1.0)
        for x, y in points:
            fit.observe(x, y)
        self.shape = fit.coefficients()
        self._observed = self._predicted = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y
        self.count += 1
        if self.shape is not None:
            a0, b0 = self.shape
            self._observed = d * self._observed + y
            self._predicted = d * self._predicted + a0 + b0 * x

    @property
    def scale(self) -> float:
        """Recent costs over the measured shape's (1.0 without a shape or samples)."""
        if self.shape is None or self._predicted <= 0:
            return 1.0
        return self._observed / self._predicted

    def coefficients(self) -> tuple[float, float]:
        if self.shape is not None:
            a0, b0 = self.shape
            return self.scale * a0, self.scale * b0
        if self.n == 0:
            return 0.0, 0.0
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            # No spread in x yet: attribute everything to the fixed cost (optimistic for speculation).
            return my, 0.0
        b = max(0.0, (self.sxy / self.n - mx * my) / var)
        a = max(0.0, my - b * mx)
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class SpecGate:
    """Per batch-size bucket: measured tokens/s with speculation on vs off; run the better one."""

    def __init__(
        self,
        explore_every: int = 8,
        decay: float = 0.8,
        min_samples: int = 3,
        explore_cost: float = 0.01,
        max_explore: int = 256,
        stale_decay: float = 0.97,
    ) -> None:
        self.stale_decay = stale_decay
        self.explore_every = explore_every
        self.explore_cost = explore_cost
        self.max_explore = max_explore
        self.decay = decay
        self.min_samples = min_samples
        # bucket -> {mode: [weighted tokens, weighted seconds, samples]}
        self._stats: dict[int, dict[bool, list[float]]] = {}
        self._steps: dict[int, int] = {}
        # bucket -> (mode, steps left) of an exploration in progress
        self._burst: dict[int, tuple[bool, int]] = {}
        # Running mean of what switching a draft model on costs (its catch-up), in steps.
        self.switch_steps = 0.0
        # Whether the last `choose` picked "on" to measure it rather than as the measured winner.
        self.exploring = False

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return max(1, num_decoding).bit_length()

    def rate(self, bucket: int, on: bool) -> float | None:
        st = self._stats.get(bucket, {}).get(on)
        if st is None or st[2] < self.min_samples or st[1] <= 0:
            return None
        return st[0] / st[1]

    def explore_interval(self, on_rate: float, off_rate: float) -> int:
        """Steps between explorations, each `min_samples` steps of the worse mode long. Exploring
        "on" from "off" also pays `switch_steps`: a draft model first catches up on what it missed."""
        loss = max(on_rate, off_rate) / max(min(on_rate, off_rate), 1e-12) - 1.0
        switch = self.switch_steps if off_rate > on_rate else 0.0
        steps = math.ceil((self.min_samples * loss + switch) / self.explore_cost)
        return max(self.explore_every, min(self.max_explore, steps))

    def observe_switch(self, steps: float) -> None:
        """What a step's draft catch-up cost, in steps of that step's own time."""
        self.switch_steps = self.decay * self.switch_steps + (1.0 - self.decay) * steps

    def _explore(self, b: int, mode: bool) -> bool:
        """Start an exploration of `mode`: `min_samples` consecutive steps, so the refreshed rate
        is a mean over several steps and not one noisy one (a step's tokens vary with acceptance)."""
        if self.min_samples > 1:
            self._burst[b] = (mode, self.min_samples - 1)
        return mode

    def _measured(self, bucket: int) -> bool | None:
        on_rate, off_rate = self.rate(bucket, True), self.rate(bucket, False)
        return None if on_rate is None or off_rate is None else on_rate >= off_rate

    def _borrowed(self, bucket: int) -> bool | None:
        """The nearest informative neighbour's verdict: off from below, on from above."""
        for other in sorted(self._stats, key=lambda o: abs(o - bucket)):
            verdict = self._measured(other)
            if verdict is False and other < bucket:
                return False
            if verdict is True and other > bucket:
                return True
        return None

    def preferred(self, num_decoding: int) -> bool:
        """The better mode so far, without counting a step or exploring."""
        b = self.bucket(num_decoding)
        verdict = self._measured(b)
        if verdict is None:
            verdict = self._borrowed(b)
        if verdict is None:  # nothing known: try "on" first
            return self.rate(b, True) is None
        return verdict

    def choose(self, num_decoding: int) -> bool:
        """The mode for a pure-decode step: the better one, or (now and then) the other. Sets
        `exploring`: "on" chosen without a measured verdict that it is the better mode."""
        on = self._choose(num_decoding)
        self.exploring = on and self._measured(self.bucket(num_decoding)) is not True
        return on

    def _choose(self, num_decoding: int) -> bool:
        b = self.bucket(num_decoding)
        step = self._steps[b] = self._steps.get(b, 0) + 1
        burst = self._burst.pop(b, None)
        if burst is not None:
            mode, left = burst
            if left > 1:
                self._burst[b] = (mode, left - 1)
            return mode
        on_rate, off_rate = self.rate(b, True), self.rate(b, False)
        if on_rate is None or off_rate is None:
            borrowed = self._borrowed(b)
            if borrowed is None:  # try "on" first, then "off"
                return on_rate is None
            if self.rate(b, borrowed) is None:
                return borrowed
            # The borrowed mode is measured here; sample the other one on the slow schedule.
            return self._explore(b, not borrowed) if step % self.max_explore == 0 else borrowed
        best = on_rate >= off_rate
        if step % self.explore_interval(on_rate, off_rate) == 0:
            return self._explore(b, not best)
        return best

    def observe(self, num_decoding: int, on: bool, tokens: int, seconds: float) -> None:
        modes = self._stats.setdefault(self.bucket(num_decoding), {})
        st = modes.setdefault(on, [0.0, 0.0, 0])
        st[0] = self.decay * st[0] + tokens
        st[1] = self.decay * st[1] + seconds
        st[2] += 1
        # The mode not run ages with every step of the other: when it is next explored, that fresh
        # sample outweighs old ones, so the two rates compare like with like as acceptance drifts.
        other = modes.get(not on)
        if other is not None:
            other[0] *= self.stale_decay
            other[1] *= self.stale_decay


# Weight of the past in the running mean of `spec_overhead`, per drafting step.
OVERHEAD_DECAY = 0.9
# Weight of the past in the running means of a draft model's catch-up: its cost per token, and its
# prompt catch-up per drafting step (which spans many requests' arrivals).
FEED_DECAY = 0.95


class AdaptiveSpeculation:
    def __init__(
        self,
        max_k: int,
        adaptive: bool = True,
        prior_accepted: float = 1.0,
        prior_rejected: float = 1.0,
        history_decay: float = 0.9,
        warmup_steps: int = 8,
        explore_z: float = 0.5,
    ) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.step_cost = LinearCost()
        self.draft_cost = LinearCost()
        self.prior = (prior_accepted, prior_rejected)
        self.history_decay = history_decay
        self.warmup_steps = warmup_steps
        self.explore_z = explore_z
        self._acc: dict[str, tuple[float, float]] = {}
        self.gate = SpecGate()
        # Seconds a step that drafts costs beyond T(t) and its draft passes (learned; see observe_step).
        self.spec_overhead = 0.0
        # Seconds per token a draft model takes to catch up (timed at load, learned online), and the
        # running mean of prompt catch-up per drafting step (see observe_outcome).
        self.feed_cost = 0.0
        self.feed_mean = 0.0
        # The last pure-decode step's (decoding requests, speculation on), for `observe_outcome`.
        self.pending: tuple[int, bool] | None = None

    # -- estimates -------------------------------------------------------

    def _posterior(self, request_id: str) -> tuple[float, float]:
        """The mean of the request's Beta posterior on per-token acceptance, and its pseudo-count."""
        a, r = self._acc.get(request_id, (0.0, 0.0))
        pa, pr = self.prior
        n = a + r + pa + pr
        return (a + pa) / n, n

    def alpha(self, request_id: str) -> float:
        """The request's estimated per-token acceptance: the mean of its Beta posterior."""
        return self._posterior(request_id)[0]

    def optimistic_alpha(self, request_id: str) -> float:
        """The acceptance the plan prices a request's drafts at: the posterior mean plus `explore_z`
        standard deviations. With little evidence (a new request, or an old one whose history has
        faded) it is high, so the request drafts and its acceptance gets measured; with much, it is
        close to the mean. Priced at the mean, a new request whose prior makes drafting only break
        even never drafts, so never learns that it would pay (measured: a draft model that fixed
        k=4 runs 1.13-1.26x faster at one request stayed at 1.01x)."""
        mean, n = self._posterior(request_id)
        return min(1.0, mean + self.explore_z * math.sqrt(mean * (1.0 - mean) / (n + 1.0)))

    def observe_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        a, r = self._acc.get(request_id, (0.0, 0.0))
        d = self.history_decay
        self._acc[request_id] = (d * a + num_accepted, d * r + (1.0 if num_accepted < num_draft else 0.0))

    def observe_step(self, num_tokens: int, seconds: float, drafted: bool = False) -> None:
        """A pure-decode step's seconds (draft passes excluded). With a measured shape, steps that
        verified drafts only teach `spec_overhead`, what speculating adds beyond the shape's tokens
        (proposals, verification, rewinds: Python per step), and the rest rescale the shape."""
        if drafted and self.step_cost.shape is not None:
            residual = seconds - self.step_cost.predict(num_tokens)
            self.spec_overhead = OVERHEAD_DECAY * self.spec_overhead + (1 - OVERHEAD_DECAY) * residual
        else:
            self.step_cost.observe(num_tokens, seconds)

    def observe_draft_pass(self, num_requests: int, seconds: float) -> None:
        self.draft_cost.observe(num_requests, seconds)

    def observe_feed(self, tokens: int, seconds: float) -> None:
        """A draft pass's catch-up: `tokens` fed beyond a proposal's own, taking `seconds` more than
        a plain pass."""
        if tokens > 0:
            per_token = seconds / tokens
            self.feed_cost = (
                per_token
                if self.feed_cost == 0.0
                else FEED_DECAY * self.feed_cost + (1 - FEED_DECAY) * per_token
            )

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)

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
        tokens: int,
        seconds: float,
        drafted: bool = True,
        pure: bool = True,
        switch_seconds: float = 0.0,
        feed_seconds: float = 0.0,
    ) -> None:
        """Output tokens and wall time of the step just planned (used when it was a pure-decode step).

        `drafted`: whether any request drafted. An "on" step in which none did (the plan gave every
        request k = 0, or n-gram lookup found nothing) ran exactly as an "off" step, and counts as one:
        the gate then compares steps that verify drafts with steps that do not, and a mode that
        often drafts nothing cannot look like speculation that does not pay.

        `pure`: whether the step computed nothing but each decoding request's next token and its
        drafts. A step that also computed prompt tokens (a request admitted after the plan) is no
        sample of either mode: its time is mostly the prompt's.

        With a seeded step cost, the seconds are divided by its current scale (how much slower than
        at load the machine now runs steps): the gate's modes are measured at different moments,
        and this machine's speed drifts by 10-20% within seconds, which would otherwise decide
        between them as much as speculation does.

        `switch_seconds`: what the step spent on draft catch-up (not in `seconds`): a cost of
        switching speculation on, which the gate charges to exploring "on" instead of to its rate.

        `feed_seconds`: what the step (in `seconds`) spent feeding new requests' prompts to a draft
        model, a cost of speculating at all. The "on" rate pays its running mean per drafting step
        instead of this step's: paid in the one step a request arrives, a prompt's catch-up (a few
        steps' worth at one request) would swing that step's sample, and the gate with it.
        """
        if switch_seconds > 0 and seconds > 0:
            self.gate.observe_switch(switch_seconds / seconds)
        if self.pending is not None:
            n, on = self.pending
            self.pending = None
            if pure:
                if on and drafted:
                    self.feed_mean = FEED_DECAY * self.feed_mean + (1 - FEED_DECAY) * feed_seconds
                    seconds += self.feed_mean - feed_seconds
                self.gate.observe(n, on and drafted, tokens, seconds / self.step_cost.scale)

    # -- the plan --------------------------------------------------------

    def plan(
        self,
        request_ids: list[str],
        other_tokens: int,
        draft_passes_cost: bool,
        backlog: Callable[[], dict[str, float]] | None = None,
    ) -> dict[str, int]:
        """Draft length per decoding request; `other_tokens` are the step's non-speculative tokens.

        `backlog` (called only when the plan is priced): per request, the tokens a draft model must
        first catch up on (a new request's prompt, or what it missed while speculation was off) per
        step of the request's remaining life; each costs `feed_cost` once the request drafts, the
        catch-up paid off over those steps (so it keeps a request from starting to draft only where
        drafting barely pays)."""
        self.pending = None
        if not request_ids:
            return {}
        if not self.adaptive:
            return dict.fromkeys(request_ids, self.max_k)
        if other_tokens:
            # A step that carries prompt chunks does not speculate: its cost is mostly the chunks,
            # the gate cannot measure it against anything, and verification tokens there cost
            # their full share (measured: n-gram at c=64 went from 0.87-0.91x to ~1.0x of
            # speculation off when these steps stopped drafting).
            return {}
        on = self.gate.choose(len(request_ids))
        self.pending = (len(request_ids), on)
        if not on:
            return {}
        if not self.seeded and self.step_cost.count < self.warmup_steps:
            return dict.fromkeys(request_ids, self.max_k)
        # While the gate explores "on" it has budgeted the catch-up that costs (`switch_steps`);
        # priced again here, it would stop the very drafts being measured, and the stale "on" rate
        # would stand (measured: a request that fell behind while "off" never drafted again).
        owed = backlog() if backlog is not None and not self.gate.exploring else {}
        alphas = {rid: self.optimistic_alpha(rid) for rid in request_ids}
        # A step that drafts at all pays fixed costs no single draft token pays for on its own: the
        # speculation overhead, and a draft model's passes (the same however few requests draft in
        # them). So each plan is priced with them paid up front, against not drafting: n-gram one
        # plan, a draft model one per pass count (1 pass first: later passes propose tokens less
        # likely to be accepted, so once one more pass does not pay, none does).
        k = dict.fromkeys(request_ids, 0)
        best = len(request_ids) / max(self.step_cost.predict(other_tokens + len(request_ids)), 1e-9)
        for passes in range(1, self.max_k + 1) if draft_passes_cost else (0,):
            plan_p, rate = self._allocate(
                request_ids, alphas, other_tokens, passes or self.max_k, passes, owed
            )
            if rate <= best:
                break
            k, best = plan_p, rate
        # A request given no drafts produces no new acceptance evidence; let its history fade
        # toward the prior so one bad stretch does not shut it out for good.
        d = self.history_decay
        for rid, kr in k.items():
            if kr == 0 and rid in self._acc:
                a, r = self._acc[rid]
                self._acc[rid] = (a * d, r * d)
        return k

    def _allocate(
        self,
        request_ids: list[str],
        alphas: dict[str, float],
        other_tokens: int,
        cap: int,
        passes: int,
        backlog: dict[str, float],
    ) -> tuple[dict[str, int], float]:
        """Greedy: give one more draft token (up to `cap` each) to the request whose next one is most
        likely accepted, while that raises the step's expected tokens per second. With `passes`
        draft-model passes, their fixed cost is paid from the start and each drafting request adds
        its share; so is the speculation overhead, and a request's first draft token adds its
        catch-up share (`backlog`). Returns the draft lengths and the expected rate."""
        a, b = self.step_cost.coefficients()  # once, not per candidate token
        c, d = self.draft_cost.coefficients() if passes else (0.0, 0.0)
        a += max(0.0, self.spec_overhead)
        k = dict.fromkeys(request_ids, 0)
        expected = float(len(request_ids))
        tokens = other_tokens + len(request_ids)
        num_spec = 0
        feed = 0.0
        drafting = passes * (c + d)  # the passes' cost, one request in them (0 without passes)
        rate = expected / max(a + b * tokens + drafting, 1e-9)
        heap = [(-alphas[rid], rid) for rid in request_ids]
        heapq.heapify(heap)
        while heap:
            neg_gain, rid = heapq.heappop(heap)
            first = k[rid] == 0
            new_spec = num_spec + first
            new_feed = feed + self.feed_cost * backlog.get(rid, 0.0) if first else feed
            new_expected = expected - neg_gain
            new_drafting = passes * (c + d * new_spec)
            new_rate = new_expected / max(a + b * (tokens + 1) + new_drafting + new_feed, 1e-9)
            if new_rate <= rate:
                continue  # this request's next draft token does not pay; others' might
            k[rid] += 1
            num_spec, feed, expected, tokens, rate = new_spec, new_feed, new_expected, tokens + 1, new_rate
            if k[rid] < cap:
                heapq.heappush(heap, (-(alphas[rid] ** (k[rid] + 1)), rid))
        return k, rate
