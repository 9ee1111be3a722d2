"""The measured gate on top of the adaptive plan: speculation runs where it has been measured to pay.

The plan's cost model cannot see everything verification costs (draft passes, the extra sampling
rows, Python work per request), so per batch-size bucket the gate keeps the measured output tokens
per second of pure-decode steps with speculation on and off, runs the better mode, and now and then
spends a few steps on the other so both stay current (docs/speculative_decoding.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.spec.config import AdaptiveConfig


@dataclass(frozen=True, slots=True)
class GateChoice:
    """The mode for one pure-decode step. `exploring`: "on" was chosen to be measured, not as the
    mode measured to be better (the plan then does not price a catch-up the exploration has paid for)."""

    on: bool
    exploring: bool = False


@dataclass(frozen=True, slots=True)
class _BucketState:
    """A bucket's measured rates (None: fewer than `min_samples`), its own verdict, a neighbour's
    where it has none, and the mode it prefers."""

    on_rate: float | None
    off_rate: float | None
    measured: bool | None
    borrowed: bool | None
    preferred: bool


def _loss(on_rate: float, off_rate: float) -> float:
    """Steps lost per step run in the worse of two measured modes."""
    return max(on_rate, off_rate) / max(min(on_rate, off_rate), 1e-12) - 1.0


class SpecGate:
    """Per batch-size bucket: measured tokens/s with speculation on vs off; run the better one."""

    def __init__(self, config: AdaptiveConfig | None = None) -> None:
        self.config = config or AdaptiveConfig()
        # bucket -> {mode: [weighted tokens, weighted seconds, samples]}
        self._stats: dict[int, dict[bool, list[float]]] = {}
        self._steps: dict[int, int] = {}
        # bucket -> its step count when it last explored (0: never): the next exploration is due
        # an interval after it, whatever the interval has become since.
        self._explored_at: dict[int, int] = {}
        # bucket -> (mode, steps left) of an exploration in progress
        self._burst: dict[int, tuple[bool, int]] = {}
        # bucket -> the verdict its last exploration set out to check, and the doublings of its
        # exploration interval (explorations in a row that found the same verdict; see `_choose`).
        self._explored_verdict: dict[int, bool] = {}
        self._backoff: dict[int, int] = {}
        # Running mean of what switching a draft model on costs (its catch-up), in steps.
        self.switch_steps = 0.0
        # All buckets: steps chosen, and what the steps run in a mode not measured better there
        # lost against the better one, in steps (a close call's exploration costs next to nothing).
        self.steps = 0
        self.explored = 0.0

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return max(1, num_decoding).bit_length()

    def rate(self, bucket: int, on: bool) -> float | None:
        st = self._stats.get(bucket, {}).get(on)
        if st is None or st[2] < self.config.min_samples or st[1] <= 0:
            return None
        return st[0] / st[1]

    def explore_interval(self, on_rate: float, off_rate: float) -> int:
        """Steps between explorations, each `min_samples` steps of the worse mode long. Exploring
        "on" from "off" also pays `switch_steps`: a draft model first catches up on what it missed."""
        cfg = self.config
        loss = _loss(on_rate, off_rate)
        switch = self.switch_steps if off_rate > on_rate else 0.0
        steps = math.ceil((cfg.min_samples * loss + switch) / cfg.explore_cost)
        return max(cfg.explore_every, min(cfg.max_explore, steps))

    def observe_switch(self, steps: float) -> None:
        """What a step's draft catch-up cost, in steps of that step's own time."""
        d = self.config.gate_decay
        self.switch_steps = d * self.switch_steps + (1.0 - d) * steps

    def _explore(self, b: int, mode: bool) -> bool:
        """Start an exploration of `mode`: `min_samples` consecutive steps, so the refreshed rate
        is a mean over several steps and not one noisy one (a step's tokens vary with acceptance)."""
        self._explored_at[b] = self._steps.get(b, 0)
        if self.config.min_samples > 1:
            self._burst[b] = (mode, self.config.min_samples - 1)
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

    def _state(self, b: int) -> _BucketState:
        """Bucket `b`'s rates and verdicts, read once per step (`choose` runs every pure-decode
        step, also while speculation stays off)."""
        on_rate, off_rate = self.rate(b, True), self.rate(b, False)
        measured = None if on_rate is None or off_rate is None else on_rate >= off_rate
        borrowed = self._borrowed(b) if measured is None else None
        if measured is not None:
            preferred = measured
        elif borrowed is not None:
            preferred = borrowed
        else:  # nothing known: try "on" first
            preferred = on_rate is None
        return _BucketState(on_rate, off_rate, measured, borrowed, preferred)

    def preferred(self, num_decoding: int) -> bool:
        """The better mode so far, without counting a step or exploring."""
        return self._state(self.bucket(num_decoding)).preferred

    def _may_explore(self, loss: float) -> bool:
        """Whether the exploration budget has room for an exploration of a mode that loses `loss`."""
        cfg = self.config
        cost = cfg.min_samples * loss
        return self.explored + cost <= max(2 * cfg.min_samples, cfg.explore_budget * self.steps)

    def choose(self, num_decoding: int) -> GateChoice:
        """The mode for a pure-decode step: the better one, or (now and then, within the
        exploration budget) the other. A bucket's first tries of its unmeasured modes are what
        `preferred` says, not explorations: at most 2 * `min_samples` steps a bucket."""
        b = self.bucket(num_decoding)
        st = self._state(b)
        loss = 0.0 if st.on_rate is None or st.off_rate is None else _loss(st.on_rate, st.off_rate)
        self.steps += 1
        on = self._choose(b, st.on_rate, st.off_rate, st.borrowed, loss)
        if on != st.preferred:
            self.explored += loss
        return GateChoice(on, exploring=on and st.measured is not True)

    def _choose(
        self, b: int, on_rate: float | None, off_rate: float | None, borrowed: bool | None, loss: float
    ) -> bool:
        step = self._steps[b] = self._steps.get(b, 0) + 1
        burst = self._burst.pop(b, None)
        if burst is not None:
            mode, left = burst
            if left > 1:
                self._burst[b] = (mode, left - 1)
            return mode
        if on_rate is None or off_rate is None:
            if borrowed is None:  # try "on" first, then "off"
                return on_rate is None
            if (on_rate if borrowed else off_rate) is None:
                return borrowed
            # The borrowed mode is measured here; sample the other one on the slow schedule.
            if step - self._explored_at.get(b, 0) >= self.config.max_explore and self._may_explore(loss):
                return self._explore(b, not borrowed)
            return borrowed
        best = on_rate >= off_rate
        # Each exploration that left the verdict as it found it doubles the bucket's interval
        # (up to `explore_backoff_max` times, within `max_explore`): a clear, repeatedly confirmed
        # loss is rechecked ever more rarely; one that flips the verdict starts over. A close call
        # (its interval at `explore_every`) costs next to nothing to recheck and may flip: it
        # keeps its schedule.
        backoff = self._backoff.get(b, 0)
        interval = self._interval(b, on_rate, off_rate)
        if step - self._explored_at.get(b, 0) >= interval and self._may_explore(loss):
            last = self._explored_verdict.get(b)
            self._backoff[b] = min(backoff + 1, self.config.explore_backoff_max) if last == best else 0
            self._explored_verdict[b] = best
            return self._explore(b, not best)
        return best

    def _interval(self, b: int, on_rate: float, off_rate: float) -> int:
        """Steps between bucket `b`'s explorations, its backoff applied."""
        interval = self.explore_interval(on_rate, off_rate)
        if interval > self.config.explore_every:
            interval = max(interval, min(self.config.max_explore, interval << self._backoff.get(b, 0)))
        return interval

    def repeats(self, num_decoding: int, choice: GateChoice) -> int:
        """How many of the next `choose` calls in this bucket may go unasked, answered `choice`
        (the last one's), their steps drafting nothing and no samples: where both modes are
        measured and "off" is the better one, the calls before the next exploration check (its
        answer cannot change before then without a sample); where "on" is not measured and no
        neighbour has a verdict, any number (only a step that drafts can measure "on", and the
        answer is "on" until then). Else none: the mode chosen is there to be measured, an
        exploration is under way or just ended, or "on" was measured better, where a step that
        drafts nothing is an "off" sample the verdict may turn on (lookup methods between their
        copy stretches): unsampled, the "off" rate would rest on a few samples, and one noisy
        sample among them could turn speculation off until the next exploration."""
        b = self.bucket(num_decoding)
        if b in self._burst:
            return 0
        on_rate, off_rate = self.rate(b, True), self.rate(b, False)
        if on_rate is None:
            unmeasured = self._borrowed(b) is None and choice == GateChoice(True, exploring=True)
            return self.config.max_explore if unmeasured else 0
        if off_rate is None or on_rate >= off_rate or choice.on:
            return 0
        interval = self._interval(b, on_rate, off_rate)
        left = interval - (self._steps.get(b, 0) - self._explored_at.get(b, 0)) - 1
        if left < 0:  # due, and waiting for the budget: the steps until it allows it
            cfg = self.config
            cost = self.explored + cfg.min_samples * _loss(on_rate, off_rate)
            if cfg.explore_budget <= 0:
                return cfg.max_explore
            left = math.ceil(cost / cfg.explore_budget) - self.steps - 1
        return max(0, left)

    def skip(self, num_decoding: int, steps: int) -> None:
        """Count `steps` calls of `choose` that `repeats` promised would repeat the last choice,
        made without calling it. Their steps drafted nothing and are no samples, but "on" ages
        as the "off" samples they would have been would have aged it: else, after a long "off"
        stretch, an exploration's fresh samples would be outweighed by the stale ones that put
        "on" behind, and the verdict would stay as it was."""
        if steps > 0:
            b = self.bucket(num_decoding)
            self.steps += steps
            self._steps[b] = self._steps.get(b, 0) + steps
            on = self._stats.get(b, {}).get(True)
            if on is not None:
                stale = self.config.stale_decay**steps
                on[0] *= stale
                on[1] *= stale

    def observe(self, num_decoding: int, on: bool, tokens: int, seconds: float) -> None:
        d = self.config.gate_decay
        modes = self._stats.setdefault(self.bucket(num_decoding), {})
        st = modes.setdefault(on, [0.0, 0.0, 0])
        st[0] = d * st[0] + tokens
        st[1] = d * st[1] + seconds
        st[2] += 1
        # The mode not run ages with every step of the other: when it is next explored, that fresh
        # sample outweighs old ones, so the two rates compare like with like as acceptance drifts.
        other = modes.get(not on)
        if other is not None:
            stale = self.config.stale_decay
            other[0] *= stale
            other[1] *= stale
