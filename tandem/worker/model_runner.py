"""Turns a SchedulerOutput into one flat forward pass and sampled tokens."""

from __future__ import annotations

import numpy as np
import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.core.outputs import RunnerOutput, SchedulerOutput
from tandem.core.request import Request
from tandem.model.forward_batch import ForwardBatch
from tandem.model.loader import load_model, resolve_dtype
from tandem.worker.sampler import Sampler, SamplingBatch


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model_config = model_config
        self.block_size = engine_config.block_size
        self.dtype = resolve_dtype(engine_config.dtype, self.device)
        self.model = load_model(
            model_config, self.dtype, self.device, engine_config.attention_backend, max_model_len
        )
        self.backend = self.model.layers[0].self_attn.backend
        shape = (2, num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(model_config.num_layers)
        ]
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(engine_config.seed))
        self.generators: dict[str, torch.Generator] = {}
        self.vocab_size = model_config.vocab_size

    @staticmethod
    def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return model_config.kv_elements_per_token * block_size * itemsize

    # -- one step --------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for rid in sched.finished_ids:
            self.generators.pop(rid, None)
        if sched.block_copies:
            src = torch.tensor([s for s, _ in sched.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in sched.block_copies], device=self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]
        if sched.is_empty:
            return RunnerOutput()
        batch, samplers = self._prepare(sched)
        self.backend.prepare(batch)
        hidden = self.model(batch, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        tokens, logprobs = self.sampler(logits, self._sampling_batch(samplers))
        out = RunnerOutput()
        for req, tok, lp in zip(samplers, tokens, logprobs):
            out.sampled[req.request_id] = tok
            if lp is not None:
                out.logprobs[req.request_id] = lp
        return out

    def _prepare(self, sched: SchedulerOutput) -> tuple[ForwardBatch, list[Request]]:
        reqs, q_lens_l = sched.requests, sched.num_tokens
        num_reqs = len(reqs)
        q_lens = np.asarray(q_lens_l, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=num_reqs)
        seq_lens = starts + q_lens
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])

        input_ids: list[int] = []
        max_blocks = max(len(r.block_ids) for r in reqs)
        tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        logits_rows: list[int] = []
        samplers: list[Request] = []
        for i, req in enumerate(reqs):
            s, n = int(starts[i]), q_lens_l[i]
            input_ids.extend(req.token_ids[s : s + n])
            tables[i, : len(req.block_ids)] = req.block_ids
            if s + n == req.num_tokens:  # caught up: the last position's logits give the next token
                for member in (req, *req.pending_children):
                    logits_rows.append(int(qsl[i + 1]) - 1)
                    samplers.append(member)

        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        positions = np.arange(total) - qsl[:-1][req_of_token] + starts[req_of_token]
        bs = self.block_size
        slots = tables[req_of_token, positions // bs] * bs + positions % bs
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            query_start_loc=qsl,
            query_lens=q_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=bs,
        )
        return batch, samplers

    def _sampling_batch(self, rows: list[Request]) -> SamplingBatch:
        dev = self.device
        params = [r.sampling for r in rows]
        greedy_l = [p.greedy for p in params]
        temperature = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy_l)], device=dev
        )
        vocab = self.vocab_size
        top_k = top_p = min_p = None
        if any(p.top_k for p in params):
            top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)

        presence = frequency = repetition = counts = prompt_mask = None
        if any(p.uses_penalties for p in params):
            presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
            counts = torch.zeros(len(rows), vocab, dtype=torch.int32, device=dev)
            prompt_mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
            for i, r in enumerate(rows):
                out_ids = r.output_token_ids
                if out_ids:
                    ids = torch.tensor(out_ids, device=dev)
                    counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
                prompt_mask[i, torch.tensor(r.prompt_token_ids, device=dev)] = True

        blocked = None
        for i, r in enumerate(rows):
            sp = r.sampling
            if r.num_output_tokens < sp.min_tokens:
                stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
                if stops:
                    if blocked is None:
                        blocked = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
                    blocked[i, torch.tensor(stops, device=dev)] = True

        generators: list[torch.Generator | None] = []
        for r in rows:
            gen = None
            if r.seed is not None and not r.sampling.greedy:
                gen = self.generators.get(r.request_id)
                if gen is None:
                    gen = torch.Generator(device=dev).manual_seed(r.seed)
                    self.generators[r.request_id] = gen
            generators.append(gen)
        return SamplingBatch(
            temperature=temperature,
            greedy=torch.tensor(greedy_l, device=dev),
            all_greedy=all(greedy_l),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            output_counts=counts,
            prompt_mask=prompt_mask,
            blocked=blocked,
            generators=generators,
            num_logprobs=[p.logprobs for p in params],
        )
