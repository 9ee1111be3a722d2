"""What the scheduler asks about speculation each step: draft lengths, and n-gram proposals."""

from __future__ import annotations

from tandem.core.request import Request
from tandem.spec.config import SpeculativeConfig
from tandem.spec.controller import AdaptiveSpeculation


class SpecPlanner:
    """Pure Python: the scheduler calls `plan`; the engine feeds back timings and acceptance."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
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
        ks = self.controller.plan([r.request_id for r in decoding], other_tokens, self.proposes_in_runner)
        out = {}
        for r in decoding:
            # Drafts past max_tokens or max_model_len could never be kept.
            room = min(r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
            k = max(0, min(ks.get(r.request_id, 0), room))
            if k:
                out[r.request_id] = k
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
        self.controller.observe_acceptance(request_id, num_draft, num_accepted)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def forget(self, request_id: str) -> None:
        self.controller.forget(request_id)
