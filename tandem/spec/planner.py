"""What the scheduler asks about speculation each step: draft lengths, and n-gram proposals."""

from __future__ import annotations

from tandem.core.request import Request
from tandem.spec.config import SpeculativeConfig
from tandem.spec.controller import AdaptiveSpeculation

# Draft-model tokens per step spent catching a request's draft KV up (its prompt, or what it
# missed while speculation was off) beyond the one or two every proposal feeds. Without a cap,
# switching speculation on at high concurrency costs a draft prefill of every running request
# in one step, which the adaptive gate then (rightly) measures as a very slow "on" step. Only the
# adaptive mode caps it: a fixed `k` (adaptive=False) always drafts.
CATCH_UP_TOKENS_PER_STEP = 128
# A draft model's catch-up is priced as paid off over at most this many of the request's steps: a
# request about to end, or drafting in only a few steps, pays for it over fewer.
FEED_HORIZON_STEPS = 32


class SpecPlanner:
    """Pure Python: the scheduler calls `plan`; the engine feeds back timings and acceptance."""

    def __init__(self, config: SpeculativeConfig, max_catch_up: int | None = None) -> None:
        self.config = config
        # The most catch-up one request may feed its draft in a step (the engine passes its step
        # token budget, which bounds a prompt chunk of the target's too); None: unbounded.
        self.max_catch_up = max_catch_up
        # Draft model: tokens each request's draft has been fed (mirrors the runner's drafter, which
        # feeds num_tokens - 1 + k positions per proposal), and the step just planned. After a
        # preemption the mirror can overstate it (the drafter starts over); it only sizes the
        # catch-up budget, and what is emitted never depends on it.
        self._fed: dict[str, int] = {}
        self._planned: dict[str, int] = {}
        self.controller = AdaptiveSpeculation(config.num_speculative_tokens, adaptive=config.adaptive)
        # Totals for metrics.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    @property
    def proposes_in_runner(self) -> bool:
        return self.config.method == "draft_model"

    def plan(self, decoding: list[Request], other_tokens: int, max_model_len: int) -> dict[str, int]:
        """Draft length for each decoding request (capped where the request is about to end)."""
        backlog = (lambda: self._backlog(decoding)) if self.proposes_in_runner else None
        ks = self.controller.plan(
            [r.request_id for r in decoding], other_tokens, self.proposes_in_runner, backlog
        )
        out = {}
        for r in decoding:
            # Drafts past max_tokens or max_model_len could never be kept.
            room = min(r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
            k = max(0, min(ks.get(r.request_id, 0), room))
            if k:
                out[r.request_id] = k
        if self.proposes_in_runner and self.config.adaptive and out:
            out = self._cap_catch_up(decoding, out)
        self._planned = {r.request_id: r.num_tokens for r in decoding if r.request_id in out}
        return out

    def _behind(self, r: Request) -> int:
        """Tokens the request's draft must catch up on before proposing, beyond the one or two
        every proposal feeds."""
        fed = min(self._fed.get(r.request_id, 0), r.num_computed_tokens)
        return max(0, r.num_tokens - fed - 2)

    def _backlog(self, decoding: list[Request]) -> dict[str, float]:
        """Catch-up tokens per step over which drafting would pay them off: the request's remaining
        tokens (halved: a speculating step emits more than one), at most FEED_HORIZON_STEPS."""
        out = {}
        for r in decoding:
            behind = self._behind(r)
            if behind:
                steps = min(FEED_HORIZON_STEPS, (r.max_tokens - r.num_output_tokens) / 2)
                out[r.request_id] = behind / max(1.0, steps)
        return out

    def _cap_catch_up(self, decoding: list[Request], ks: dict[str, int]) -> dict[str, int]:
        """Drop drafts of requests whose draft would first have to catch up on more than the budget
        allows this step (the closest to caught up go first; the rest catch up in later steps).

        The closest one is kept even over the budget, up to `max_catch_up`: a draft catches up only
        by drafting, so a request further behind than the budget would otherwise never draft again
        (one whose prompt alone exceeds it, never at all). `max_catch_up` bounds the latency that
        adds to the step for everyone in it; a request behind by more stays without drafts."""
        behind = [(self._behind(r), r.request_id) for r in decoding if r.request_id in ks]
        behind.sort()
        budget = CATCH_UP_TOKENS_PER_STEP
        out = {}
        for extra, rid in behind:
            if extra <= budget or (not out and (self.max_catch_up is None or extra <= self.max_catch_up)):
                budget -= extra
                out[rid] = ks[rid]
        return out

    def propose(self, req: Request, k: int) -> list[int] | None:
        """n-gram lookup proposes here (may find fewer than k); a draft model proposes in the runner."""
        if self.config.method != "ngram":
            return None
        from tandem.spec.ngram import propose_ngram

        return propose_ngram(req.token_ids, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        num_tokens = self._planned.get(request_id)
        if num_tokens is not None:
            self._fed[request_id] = num_tokens - 1 + num_draft
        self.controller.observe_acceptance(request_id, num_draft, num_accepted)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def forget(self, request_id: str) -> None:
        self.controller.forget(request_id)
        self._fed.pop(request_id, None)
        self._planned.pop(request_id, None)
