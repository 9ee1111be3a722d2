"""Draft-model proposals for speculative decoding.

The draft keeps its own paged KV cache, indexed by the same block tables as
the target's (same block ids, its own tensors), so preemption, prefix caching
and rewinds need no copies. The draft never runs over the target's batch.
Instead each request remembers how many of its leading positions hold valid
draft KV (`valid`), and a proposal's first pass feeds everything from there
to the request's last token in one ragged batch. After a speculative step
those are only the bonus token (and the last accepted draft, which no pass
fed), because the draft already computed the accepted drafts' KV while
proposing them; after a prompt or a stretch without speculation they are all
the tokens it missed. Positions past what verification accepted are stale
and are simply overwritten later. Draft KV only affects how good the
proposals are, never what is emitted (verification is lossless). A new
request does not trust draft KV in blocks it shares through the prefix cache
or a fork, since those may never have been fed to the draft; its first pass
feeds the draft its whole prompt.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from tandem.config import QUANTIZATION_METHODS, EngineConfig, ModelConfig
from tandem.core.request import Request
from tandem.core.step_io import DraftPass
from tandem.model.loader import load_model
from tandem.worker.batch import SampleRow, build_batch
from tandem.worker.device import DevicePlan
from tandem.worker.sampler import Sampler, SamplingBatch, row_argmax


class DraftHost(Protocol):
    """What the drafter uses of the target's runner (tandem.worker.model_runner.ModelRunner): its
    KV layout (the draft's cache takes the target's `kv_cache_dtype`), placement and vocabulary, and
    its sampling, so draft tokens are drawn as the target's."""

    block_size: int
    device: torch.device
    dtype: torch.dtype
    plan: DevicePlan
    vocab_size: int
    sampler: Sampler

    def allocate_kv(self, mc: ModelConfig, num_blocks: int) -> list[torch.Tensor]: ...

    def sampling_batch(self, rows: list[SampleRow]) -> SamplingBatch: ...


class Drafter:
    def __init__(
        self,
        host: DraftHost,
        mc: ModelConfig,
        engine_config: EngineConfig,
        max_model_len: int,
    ) -> None:
        """Loads the draft model; its KV cache comes with `allocate`, once the blocks are counted."""
        if mc.vocab_size != host.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({mc.vocab_size}) differs from the target's "
                f"({host.vocab_size})"
            )
        self.host = host
        self.model_config = mc
        self.model = load_model(
            mc,
            host.dtype,
            host.device,
            host.plan.attention_backend,
            max_model_len,
            # int8 at load applies to the draft too; a checkpoint method names the target's format.
            engine_config.quantization if engine_config.quantization in QUANTIZATION_METHODS else None,
            engine_config.kv_cache_dtype,
            cpu_kernels=host.plan.cpu_kernels,
            load_format=engine_config.load_format,
            seed=engine_config.seed + 1,
        )
        self.backend = self.model.backend
        self.kv_caches: list[torch.Tensor] = []
        self.generators: dict[str, torch.Generator] = {}
        # request id -> how many leading positions hold valid draft KV
        self.valid: dict[str, int] = {}

    def allocate(self, num_blocks: int) -> None:
        self.kv_caches = self.host.allocate_kv(self.model_config, num_blocks)

    def sync(self, reqs: list[Request], preempted: list[Request], finished: list[str]) -> None:
        """Before a step: clip each request's valid draft KV to what the target has kept.

        A request seen for the first time (or again after preemption) has no draft KV it can
        trust: a cached prefix or a forked parent's blocks may never have been fed to the draft,
        because the draft catches up lazily. A rewind (rejected drafts) leaves the draft's KV
        valid only up to the target's computed tokens.
        """
        for rid in finished:
            self.valid.pop(rid, None)
            self.generators.pop(rid, None)
        for r in preempted:
            self.valid.pop(r.request_id, None)
        for r in reqs:
            self.valid[r.request_id] = min(self.valid.get(r.request_id, 0), r.num_computed_tokens)

    def propose(
        self, todo: list[tuple[Request, int]]
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], list[DraftPass]]:
        """Propose `k` tokens for each decoding request: k batched single-token draft passes."""
        host = self.host
        bs = host.block_size
        # Pass 0 starts where each request's valid draft KV ends (sync has set it).
        first = [min(self.valid[r.request_id], r.num_tokens - 1) for r, _ in todo]
        tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in todo}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in todo}
        passes: list[DraftPass] = []
        # Plain greedy rows (no penalties, no min_tokens masking) draft by argmax of the raw logits,
        # and greedy verification never reads a draft distribution: skip building either.
        plain = all(
            r.sampling.greedy
            and not r.sampling.uses_penalties
            and r.num_output_tokens >= r.sampling.min_tokens
            for r, _ in todo
        )
        for r, k in todo:
            self.valid[r.request_id] = r.num_tokens - 1 + k  # what the passes below will have fed
        for j in range(max(k for _, k in todo)):
            start = time.perf_counter()
            active = [r for r, k in todo if k > j]
            n = len(active)
            behind = missed = 0
            if j == 0:  # every position the draft has not seen, up to the last known token
                starts = first
                q_lens = [r.num_tokens - s for r, s in zip(active, starts)]
                extra = None
                # Beyond the one or two tokens every proposal feeds: the prompt, fed once per
                # request (a cost of drafting at all), and generated tokens missed while
                # speculation was off (a cost of switching it back on).
                for r, s, q in zip(active, starts, q_lens):
                    over = max(0, q - 2)
                    behind += over
                    missed += over - min(over, max(0, r.num_prompt_tokens - s))
            else:  # the previous proposal
                starts = [r.num_tokens - 1 + j for r in active]
                q_lens = [1] * n
                extra = {r.request_id: tokens[r.request_id][-1:] for r in active}
            batch, ends = build_batch(active, q_lens, bs, host.device, extra, starts_l=starts)
            self.backend.prepare(batch)
            hidden = self.model(batch, self.kv_caches)
            if len(ends) != hidden.shape[0]:
                hidden = hidden[torch.from_numpy(ends - 1).to(hidden.device)]
            logits = self.model.compute_logits(hidden)
            if plain:
                for r, t in zip(active, row_argmax(logits).tolist()):
                    tokens[r.request_id].append(t)
                seconds = time.perf_counter() - start
                passes.append(DraftPass(n, seconds, catch_up_tokens=behind, missed_tokens=missed))
                continue
            logits = logits.float()
            sb = host.sampling_batch([SampleRow(r, tokens[r.request_id]) for r in active])
            sb.generators = [self._generator(r) for r in active]
            dist = host.sampler.distribution(logits, sb)
            picked = row_argmax(dist) if sb.all_greedy else host.sampler.draw(dist, sb)
            for i, (r, t) in enumerate(zip(active, picked.tolist())):
                tokens[r.request_id].append(t)
                probs[r.request_id].append(dist[i])
            seconds = time.perf_counter() - start
            passes.append(DraftPass(n, seconds, catch_up_tokens=behind, missed_tokens=missed))
        return tokens, {rid: torch.stack(p) for rid, p in probs.items() if p}, passes

    def _generator(self, req: Request) -> torch.Generator | None:
        """Draft draws use their own stream, so a seeded request's target stream is not disturbed."""
        if req.seed is None or req.sampling.greedy:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator(device=self.host.device).manual_seed(
                req.seed ^ 0x5DEECE66D
            )
        return gen
