"""The step loop: schedule, run the model, update state, turn tokens into outputs."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.config import EngineConfig, ModelConfig
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import TokenLogprobs
from tandem.core.policy import SchedulingConfig, TenantQuota
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.tokenizer import Tokenizer
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def scheduling_config(config: EngineConfig) -> SchedulingConfig:
    tenants = {}
    for name, quota in (config.tenant_quotas or {}).items():
        if not isinstance(quota, dict):
            raise ValueError(f"tenant_quotas[{name!r}] must be a dict of weight/max_running/max_blocks")
        unknown = set(quota) - {"weight", "max_running", "max_blocks"}
        if unknown:
            raise ValueError(f"tenant_quotas[{name!r}] has unknown keys {sorted(unknown)}")
        tenants[name] = TenantQuota(**quota)
    return SchedulingConfig(
        policy=config.scheduling_policy,
        starvation_timeout_s=config.starvation_timeout_s,
        tenants=tenants,
    )


def _sample_seed(seed: int | None, index: int) -> int | None:
    """Sample 0 uses the request's seed; others get distinct streams derived from (seed, index)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(slots=True)
class _Sample:
    """Engine-side state of one output sequence."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class _Group:
    """One user request: a prompt and its `n` samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[_Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_batched_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        import torch

        from tandem.worker.model_runner import ModelRunner

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings and mc.rope.rope_type == "default":
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                f"({mc.max_position_embeddings})"
            )
        self.num_blocks = self._num_blocks(config, mc)
        self.runner = ModelRunner(mc, config, self.num_blocks, self.max_model_len)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            scheduling_config(config),
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.groups: dict[str, _Group] = {}
        self.stats = EngineStats()

    def _num_blocks(self, config: EngineConfig, mc: ModelConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        import torch

        from tandem.model.loader import resolve_dtype
        from tandem.worker.model_runner import ModelRunner

        dtype = resolve_dtype(config.dtype, torch.device("cpu"))
        per_block = ModelRunner.kv_bytes_per_block(mc, config.block_size, dtype)
        by_memory = config.kv_cache_memory // per_block
        # More blocks than every sequence slot at full length cannot be used.
        by_need = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        num = min(by_memory, by_need)
        if num < 1:
            raise ValueError(
                f"kv_cache_memory ({config.kv_cache_memory} bytes) is smaller than one KV block "
                f"({per_block} bytes)"
            )
        return num

    # -- requests --------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
            tenant = prompt.get("tenant", tenant)
        for name, value in (("cache_salt", cache_salt), ("tenant", tenant)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
            if max_tokens < 1:
                raise ValueError(
                    f"the prompt ({len(ids)} tokens) leaves no room to generate within "
                    f"max_model_len ({self.max_model_len})"
                )
        self.scheduler.check_fits(len(ids), max_tokens, params.n)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        members = []
        for i in range(params.n):
            seed = _sample_seed(params.seed, i)
            members.append(
                Request(
                    request_id=request_id if i == 0 else f"{request_id}#{i}",
                    prompt_token_ids=ids,
                    sampling=params,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                    tenant=tenant,
                    cache_salt=cache_salt,
                    group_id=request_id,
                    sample_index=i,
                    seed=seed,
                )
            )
        leader = members[0]
        leader.pending_children = members[1:]
        self.scheduler.add_request(leader)
        self.stats.num_prompt_tokens += len(ids)
        group = _Group(request_id, text, ids, params, arrival)
        backend = self.tokenizer.backend
        for r in members:
            group.samples.append(
                _Sample(
                    r,
                    IncrementalDetokenizer(backend, ids, params),
                    [] if params.logprobs is not None else None,
                )
            )
        self.groups[request_id] = group

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, list):
            ids, text = prompt, None
        else:
            raise ValueError(
                f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
            )
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return text, list(ids)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self.groups.pop(rid, None)
            if group is not None:
                ids = [s.request.request_id for s in group.samples]
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------

    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        """Run one scheduling step; return outputs of the requests it advanced.

        With `emit_unfinished=False` only finished requests are returned (the
        offline path), sparing a per-step copy of every running output.
        """
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        if sched.is_empty:
            return []
        changed = self.scheduler.update(sched, result)
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += sched.total_tokens
        self.stats.num_generation_tokens += len(changed)
        touched: dict[str, _Group] = {}
        for req in changed:
            group = self.groups.get(req.group_id)
            if group is None:
                continue
            sample = group.samples[req.sample_index]
            token = req.token_ids[-1]
            # A stop token ends the text without being part of it.
            stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
            hit = sample.detok.update(token, decode=not stopped_by_token)
            if hit is not None:
                if req.is_finished:  # the same token also hit max_tokens: the stop string wins, as in vLLM
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, hit
                else:
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED, hit)
            elif req.is_finished:
                sample.detok.flush()
            if sample.logprobs is not None:
                self._add_logprobs(sample, token, result.logprobs.get(req.request_id))
            touched[group.request_id] = group
        outputs = []
        for g in touched.values():
            finished = g.finished
            if finished or emit_unfinished:
                outputs.append(self._output(g))
            if finished:
                self.groups.pop(g.request_id, None)
        return outputs

    def _add_logprobs(self, sample: _Sample, token: int, lp: TokenLogprobs | None) -> None:
        if lp is None:
            return
        decode = self.tokenizer.decode_token
        entry = {
            tid: Logprob(val, rank + 1, decode(tid))
            for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs))
        }
        if token not in entry:
            entry = {token: Logprob(lp.logprob, lp.rank, decode(token)), **entry}
        sample.logprobs.append(entry)
        sample.cumulative_logprob += lp.logprob

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for s in group.samples:
            r = s.request
            finished = r.is_finished
            completions.append(
                CompletionOutput(
                    index=r.sample_index,
                    text=s.detok.visible_text(finished),
                    token_ids=list(r.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    logprobs=s.logprobs,
                    finish_reason=r.status.finish_reason if finished else None,
                    stop_reason=r.stop_reason,
                )
            )
        lead = group.samples[0].request
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=lead.first_scheduled_time,
            first_token_time=lead.first_token_time,
            last_token_time=lead.token_times[-1] if lead.token_times else None,
            finished_time=lead.finished_time,
            num_preemptions=sum(s.request.num_preemptions for s in group.samples),
            num_cached_tokens=lead.num_cached_tokens,
            token_times=list(lead.token_times) if lead.is_finished else [],
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            metrics=metrics,
        )
