"""Draft-model proposals for speculative decoding.

The draft keeps its own paged KV cache, indexed by the same block tables as
the target's (same block ids, its own tensors), so preemption, prefix caching
and rewinds need nothing extra: the draft runs over every batch the target
runs while anyone speculates (`catch_up`), and a rejected token's slot is
simply overwritten later. In steps where nobody speculates (the adaptive gate
has turned speculation off) the draft does no work at all; the positions it
skipped are remembered per request (`stale`) and computed in one batched pass
(`fill_holes`) before that request next gets drafts. Draft KV only affects how
good the proposals are, never what is emitted (verification is lossless), so
a prefix-cache hit whose draft KV was never written costs acceptance, not
correctness.
"""

from __future__ import annotations

import time

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.core.request import Request
from tandem.model.forward_batch import ForwardBatch
from tandem.model.loader import load_model


class Drafter:
    def __init__(
        self, runner, mc: ModelConfig, engine_config: EngineConfig, num_blocks: int, max_model_len: int
    ) -> None:
        if mc.vocab_size != runner.model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({mc.vocab_size}) differs from the target's "
                f"({runner.model_config.vocab_size})"
            )
        self.runner = runner
        self.model = load_model(
            mc,
            runner.dtype,
            runner.device,
            engine_config.attention_backend,
            max_model_len,
            engine_config.quantization,
        )
        self.backend = self.model.layers[0].self_attn.backend
        self.kv_caches = runner.allocate_kv(mc, num_blocks)
        self.generators: dict[str, torch.Generator] = {}
        # request id -> first position whose draft KV was skipped
        self.stale: dict[str, int] = {}

    def catch_up(self, batch: ForwardBatch) -> None:
        """Write the draft's KV for every token the target just computed."""
        if self.backend.sliding_window != self.runner.backend.sliding_window:
            self.backend.prepare(batch)
        self.model(batch, self.kv_caches)

    def mark_stale(self, reqs: list[Request]) -> None:
        for r in reqs:
            start = r.num_computed_tokens
            if self.stale.get(r.request_id, start + 1) > start:
                self.stale[r.request_id] = start

    def fill_holes(self, reqs: list[Request]) -> None:
        """Compute the draft KV a request's skipped steps left out, up to (not incl.) its last token."""
        from tandem.worker.model_runner import build_batch

        todo = [r for r in reqs if self.stale.get(r.request_id, r.num_tokens) < r.num_tokens - 1]
        starts = [self.stale[r.request_id] for r in todo]
        for r in reqs:
            self.stale.pop(r.request_id, None)
        if not todo:
            return
        q_lens = [r.num_tokens - 1 - s for r, s in zip(todo, starts)]
        batch, _ = build_batch(todo, q_lens, self.runner.block_size, self.runner.device, starts_l=starts)
        self.backend.prepare(batch)
        self.model(batch, self.kv_caches)

    def propose(
        self, todo: list[tuple[Request, int]]
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], list[tuple[int, float]]]:
        """Propose `k` tokens for each decoding request: k batched single-token draft passes."""
        from tandem.worker.model_runner import SampleRow, build_batch

        runner = self.runner
        bs = runner.block_size
        tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in todo}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in todo}
        times: list[tuple[int, float]] = []
        # Plain greedy rows (no penalties, no min_tokens masking) draft by argmax of the raw logits,
        # and greedy verification never reads a draft distribution: skip building either.
        plain = all(
            r.sampling.greedy
            and not r.sampling.uses_penalties
            and r.num_output_tokens >= r.sampling.min_tokens
            for r, _ in todo
        )
        for j in range(max(k for _, k in todo)):
            start = time.perf_counter()
            active = [r for r, k in todo if k > j]
            n = len(active)
            # Pass 0 feeds each request's last known token; later passes feed the previous proposal.
            extra = {r.request_id: tokens[r.request_id][-1:] for r in active} if j else None
            starts = [r.num_tokens - 1 + j for r in active]
            batch, _ = build_batch(active, [1] * n, bs, runner.device, extra, starts_l=starts)
            self.backend.prepare(batch)
            logits = self.model.compute_logits(self.model(batch, self.kv_caches))
            if plain:
                for r, t in zip(active, logits.argmax(dim=-1).tolist()):
                    tokens[r.request_id].append(t)
                times.append((n, time.perf_counter() - start))
                continue
            logits = logits.float()
            sb = runner.sampling_batch([SampleRow(r, tokens[r.request_id]) for r in active])
            sb.generators = [self._generator(r) for r in active]
            dist = runner.sampler.distribution(logits, sb)
            picked = dist.argmax(dim=-1) if sb.all_greedy else runner.sampler.draw(dist, sb)
            for i, (r, t) in enumerate(zip(active, picked.tolist())):
                tokens[r.request_id].append(t)
                probs[r.request_id].append(dist[i])
            times.append((n, time.perf_counter() - start))
        return tokens, {rid: torch.stack(p) for rid, p in probs.items() if p}, times

    def _generator(self, req: Request) -> torch.Generator | None:
        """Draft draws use their own stream, so a seeded request's target stream is not disturbed."""
        if req.seed is None or req.sampling.greedy:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator().manual_seed(req.seed ^ 0x5DEECE66D)
        return gen
