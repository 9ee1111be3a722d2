"""The engine core: scheduler, KV cache and model runner behind a token-ids-in, token-ids-out interface.

No tokenizer lives here: text goes in and out in the front end (`processor.py`),
so the core can run in its own process and never stall on HTTP, tokenization
or detokenization. Messages in and out are plain dataclasses.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from tandem.config import (
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_RECOMPUTE_TFLOPS_CPU,
    DEFAULT_RECOMPUTE_TFLOPS_CUDA,
    DEFAULT_SWAP_BANDWIDTH_GBPS_CPU,
    DEFAULT_SWAP_BANDWIDTH_GBPS_CUDA,
    DEFAULT_SWAP_SPACE_GIB_CUDA,
    EngineConfig,
    ModelConfig,
)
from tandem.core.engine_io import EngineCoreRequest, SampleOutput, sample_request
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.limits import EngineLimits
from tandem.core.overlap import FAULT, sync_reason, without_finished
from tandem.core.policy import SchedulingConfig, parse_tenant_quotas
from tandem.core.preemption import PreemptionCost, model_flops
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.core.stats import DERIVED, EngineCounters, bump
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.core.step_shape import shape_of
from tandem.engine.step_trace import StepTrace
from tandem.kvtransfer.protocol import SampleState
from tandem.spec.config import AdaptiveConfig, SpeculativeConfig
from tandem.spec.planner import SpecPlanner
from tandem.structured.manager import StructuredOutputManager

# Batches (decode rows plus drafts) up to this many rows get their GEMM primitives built at load:
# oneDNN's first use of a row count costs ms, which would land in a timed step.
WARM_MAX_ROWS = 64
# How long a step with nothing to run waits for a grammar being compiled (then it returns, so the
# engine loop sees new input).
GRAMMAR_WAIT_S = 0.05
# Failed steps in a row after which a fault is taken as the engine's, not a request's: each failed
# step fails its culprit requests, so a fault that outlives this many of them is not theirs.
MAX_FAULTED_STEPS = 8

logger = logging.getLogger("tandem.engine")


@dataclasses.dataclass(slots=True)
class InFlight:
    """A step launched ahead of the host (overlap scheduling), collected by the next step() call."""

    sched: SchedulerOutput
    handle: Any  # tandem.worker.step_handle.StepHandle (the engine core imports no torch-side type)
    placed: list[Request]  # the requests `Scheduler.advance` gave a placeholder
    # perf_counter and monotonic clocks its seconds run from (set to the collecting call's start).
    start: float
    began: float


def scheduling_config(config: EngineConfig) -> SchedulingConfig:
    return SchedulingConfig(
        policy=config.scheduling_policy,
        starvation_timeout_s=config.starvation_timeout_s,
        tenants=parse_tenant_quotas(config.tenant_quotas),
    )


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings and mc.rope.rope_type == "default":
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
            f"({mc.max_position_embeddings})"
        )
    return max_model_len


def swap_space_bytes(config: EngineConfig, device: str) -> int:
    """Bytes of host memory for swapped-out KV (`swap_space` GiB; by default some on CUDA, none on
    a CPU, whose KV cache is in host memory already)."""
    gib = config.swap_space
    if gib is None:
        gib = DEFAULT_SWAP_SPACE_GIB_CUDA if device == "cuda" else 0.0
    return int(gib * (1 << 30))


def preemption_cost(config: EngineConfig, mc: ModelConfig, block_bytes: int, device: str) -> PreemptionCost:
    """The cost model that picks swap or recompute per victim, from the engine's arguments (or the
    device's defaults) and the model's shape."""
    cuda = device == "cuda"
    gbps = config.swap_bandwidth_gbps or (
        DEFAULT_SWAP_BANDWIDTH_GBPS_CUDA if cuda else DEFAULT_SWAP_BANDWIDTH_GBPS_CPU
    )
    tflops = config.recompute_tflops or (
        DEFAULT_RECOMPUTE_TFLOPS_CUDA if cuda else DEFAULT_RECOMPUTE_TFLOPS_CPU
    )
    linear, attention = model_flops(mc)
    return PreemptionCost(
        block_bytes=block_bytes,
        linear_flops_per_token=linear,
        attention_flops_per_pair=attention,
        link_bytes_per_s=gbps * 1e9,
        flops_per_s=tflops * 1e12,
        mode=config.preemption_mode,
    )


def num_kv_blocks(config: EngineConfig, mc: ModelConfig, max_model_len: int, device: str = "cpu") -> int | None:
    """The KV cache's blocks from num_kv_blocks or kv_cache_memory; None on CUDA when neither is
    given: the runner sizes it from the GPU's memory (gpu_memory_utilization)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is None and device == "cuda":
        return None
    import torch

    from tandem.model.kv_quant import KVCacheFormat
    from tandem.model.loader import resolve_dtype
    from tandem.worker.model_runner import ModelRunner

    memory = DEFAULT_KV_CACHE_MEMORY if config.kv_cache_memory is None else config.kv_cache_memory
    kv_format = KVCacheFormat(config.kv_cache_dtype, resolve_dtype(config.dtype, torch.device(device)))
    per_block = ModelRunner.kv_bytes_per_block(mc, config.block_size, kv_format)
    by_memory = memory // per_block
    if by_memory < 1:
        raise ValueError(f"kv_cache_memory ({memory} bytes) is smaller than one KV block ({per_block} bytes)")
    # Without prefix caching, more blocks than every sequence slot at full length cannot be used.
    if not config.enable_prefix_caching:
        by_memory = min(by_memory, config.max_num_seqs * -(-max_model_len // config.block_size))
    return by_memory


def load_draft_config(path: str | None, config: EngineConfig) -> ModelConfig:
    """The draft checkpoint's config; its tokenizer must be the target's."""
    import json
    from pathlib import Path

    draft = ModelConfig.from_pretrained(path or "")
    target_tok = Path(config.tokenizer or config.model) / "tokenizer.json"
    draft_tok = Path(draft.path) / "tokenizer.json"
    if target_tok.is_file() and draft_tok.is_file():
        vocab_t = json.loads(target_tok.read_text()).get("model", {}).get("vocab")
        vocab_d = json.loads(draft_tok.read_text()).get("model", {}).get("vocab")
        if vocab_t != vocab_d:
            raise ValueError(
                f"the draft model {draft.path!r} does not share the target's tokenizer "
                "(tokenizer.json vocabularies differ)"
            )
    return draft


def default_head_path(model: str, method: str) -> str:
    """An EAGLE or Medusa head given no folder: the one beside the target's, `<target>-<method>`
    (the embedded default model's ships in the package: tandem/checkpoints/default-eagle)."""
    from pathlib import Path

    folder = Path(model)
    head = folder.with_name(f"{folder.name}-{method}")
    if not (head / "config.json").is_file():
        raise ValueError(
            f"speculative_config method {method!r} without a model: no head beside the target at {str(head)!r}; "
            f"train one with `tandem train-draft --model {model} --method {method} --out {head}`"
        )
    return str(head)


class EngineCore:
    def __init__(self, config: EngineConfig, extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        import torch

        from tandem.worker.device import resolve_device_plan
        from tandem.worker.model_runner import ModelRunner

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        self.max_model_len = resolve_max_model_len(config, mc)
        # Where the model runs and what follows from it (tandem/worker/device.py).
        self.plan = resolve_device_plan(config, graph_safe=mc.moe is None)
        num_blocks = num_kv_blocks(config, mc, self.max_model_len, self.plan.device)
        # The checkpoint's EOS ids plus the tokenizer's, which the front end passes in.
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids) | set(extra_eos_token_ids)))
        self.spec_config = SpeculativeConfig.from_dict(config.speculative_config)
        draft_mc = None
        if self.spec_config is not None and self.spec_config.method == "draft_model":
            draft_mc = load_draft_config(self.spec_config.model, config)
        if self.spec_config is not None and self.spec_config.uses_head and not self.spec_config.model:
            self.spec_config = dataclasses.replace(
                self.spec_config, model=default_head_path(config.model, self.spec_config.method)
            )
        self.runner = ModelRunner(
            mc,
            config,
            num_blocks,
            self.max_model_len,
            draft_model_config=draft_mc,
            plan=self.plan,
            speculative_config=self.spec_config,
        )
        self.num_blocks = self.runner.num_blocks
        k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
        self.runner.warm(min(WARM_MAX_ROWS, config.max_num_seqs * (1 + k)))
        # Preemption by swap: the swap space (host memory) and the cost model choosing swap or recompute.
        num_swap_blocks = self.runner.allocate_swap(swap_space_bytes(config, self.plan.device))
        if num_swap_blocks:
            logger.info("swap space: %d KV blocks in host memory", num_swap_blocks)
        self.kv = KVCacheManager(
            self.num_blocks, config.block_size, config.enable_prefix_caching, num_swap_blocks
        )
        self.preemption = preemption_cost(config, mc, self.runner.swap_block_bytes(), self.plan.device)
        # What a KV transfer needs to know of this engine's blocks (tandem.kvtransfer.host.KVHost).
        self.block_size = config.block_size
        self.kv_block_bytes = self.runner.kv_bytes_per_block(mc, config.block_size, self.runner.kv_format)
        self.kv_format_name = self.runner.kv_format.name
        # One set of counters for the whole engine: the scheduler and the planner count in it too.
        self.counters = EngineCounters()
        self.spec: SpecPlanner | None = None
        if self.spec_config is not None:
            self.spec = SpecPlanner(
                self.spec_config, max_catch_up=config.max_num_batched_tokens, counters=self.counters
            )
            if self.spec_config.adaptive:
                self._seed_costs(self.spec, config, k, self.spec_config.adaptive_config)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            scheduling_config(config),
            spec=self.spec,
            counters=self.counters,
            preemption=self.preemption,
        )
        self.limits = EngineLimits(
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=config.max_num_seqs,
            eos_token_ids=self.eos_token_ids,
        )
        # user request id -> ids of its samples' Requests
        self._groups: dict[str, list[str | None]] = {}
        # user request id -> the front end's run of it this engine has (echoed in its outputs)
        self._incarnations: dict[str, int] = {}
        # Steps in a row that failed (see `_isolate_fault`); a successful step resets it.
        self._faulted_steps = 0
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model,
            mc.vocab_size,
            self.eos_token_ids,
            config.structured_outputs_cache_size,
            config.structured_outputs_cache_bytes,
        )
        self.runner.grammar = self.structured
        # Structured-output requests whose grammar is being compiled: they join the scheduler when
        # it is ready, so a slow compile never holds up a step.
        self._awaiting_grammar: dict[str, tuple[EngineCoreRequest, Future[Any]]] = {}
        self.step_trace = StepTrace(config.step_trace) if config.step_trace else None
        # Overlap scheduling (tandem/core/overlap.py): the step launched and not yet collected;
        # outputs of one collected outside step() (before a move reads its request), for the next.
        # Speculation plans from the tokens on the host every step: it keeps the synchronous loop.
        self.overlap = self.plan.async_scheduling and self.spec is None
        self._in_flight: InFlight | None = None
        self._held: list[SampleOutput] = []
        # Steps run synchronously in overlap mode, by reason (`sync_reason`); steps launched ahead.
        self.overlap_sync_steps: dict[str, int] = {}
        self.overlap_steps = 0

    def _seed_costs(self, spec: SpecPlanner, config: EngineConfig, k: int, adaptive: AdaptiveConfig) -> None:
        """Time verification steps and draft passes of one request and of a full batch now, so the
        adaptive plan knows what speculation costs from its first step."""
        context = adaptive.seed_context
        n = max(
            1, min(adaptive.seed_max_requests, config.max_num_seqs, config.max_num_batched_tokens // (1 + k))
        )
        shapes = [(1, 1), (1, 1 + k), (n, 1), (n, 1 + k)]
        draft_requests = [1, n] if self.runner.drafter is not None else []
        feed = 0.0
        try:
            seconds = self.runner.time_passes(shapes, context)
            draft_seconds = []
            if draft_requests:
                # Plus one request's catch-up on a context's worth of tokens: the per-token feed cost.
                *draft_seconds, catch_up = self.runner.time_passes(
                    [(r, 1) for r in draft_requests] + [(1, context)], context, draft=True
                )
                feed = max(0.0, catch_up - draft_seconds[0]) / (context - 1)
        except ValueError:  # a cache too small to time a pass in: learn online instead
            return
        spec.seed_costs(
            [(r * q, s) for (r, q), s in zip(shapes, seconds)], list(zip(draft_requests, draft_seconds)), feed
        )

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self._groups or req.request_id in self._awaiting_grammar:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        params = req.params
        self.limits.check(req.prompt_token_ids, req.max_tokens, params.n, params.stop_ids)
        resumed = req.resumed_outputs
        if resumed is not None and len(resumed) != params.n:
            raise ValueError(f"resumed_outputs has {len(resumed)} entries for n={params.n} samples")
        if self.step_trace is not None:
            self.step_trace.added(req.request_id, time.monotonic(), req.arrival_time)
        if params.structured_outputs is not None:
            pending = self.structured.prepare(req.request_id, params.structured_outputs)
            if pending is not None:
                self._awaiting_grammar[req.request_id] = (req, pending)
                return
        self._admit(req)

    def _admit(self, req: EngineCoreRequest) -> None:
        params = req.params
        resumed = req.resumed_outputs
        if resumed is None:
            # A leader computes the prompt once; the other samples fork off its blocks.
            members = [self.make_member(req, i) for i in range(params.n)]
            members[0].pending_children = members[1:]
            self.scheduler.add_request(members[0])
            ids: list[str | None] = [r.request_id for r in members]
        else:
            # Samples that diverged go on separately (each recomputes its own context).
            ids = []
            for i, outputs in enumerate(resumed):
                if outputs is None:
                    ids.append(None)
                    continue
                r = self.make_member(req, i, outputs)
                self.scheduler.add_request(r)
                ids.append(r.request_id)
        self._groups[req.request_id] = ids
        self._incarnations[req.request_id] = req.incarnation
        self.counters.prompt_tokens += len(req.prompt_token_ids)

    def make_member(self, req: EngineCoreRequest, index: int, outputs: list[int] | None = None) -> Request:
        """The scheduler's Request for sample `index` of `req`, with `outputs` already produced."""
        return sample_request(req, index, outputs, self.eos_token_ids)

    def samples(self, request_id: str) -> list[Request | None] | None:
        """A user request's samples as the scheduler holds them (None: one that has ended), or None."""
        if self._in_flight is not None:
            self._collect_in_flight()  # a move reads their tokens: none may be a placeholder
        ids = self._groups.get(request_id)
        if ids is None:
            return None
        return [None if i is None else self.scheduler.requests.get(i) for i in ids]

    def install(self, req: EngineCoreRequest, samples: Sequence[SampleState | None]) -> None:
        """Run a request whose samples arrive with their KV computed elsewhere: each sample's
        `block_ids` are blocks here, filled, and it takes a reference on them; its seats were
        reserved. The leaders (those no other sample will fork off) run now."""
        if req.request_id in self._groups:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        members: list[Request | None] = []
        for i, st in enumerate(samples):
            if st is None:
                members.append(None)
                continue
            r = self.make_member(req, i, st.output_token_ids)
            r.num_computed_tokens = st.num_computed_tokens
            r.num_preemptions = st.num_preemptions
            r.num_cached_tokens = st.num_cached_tokens
            r.protected_until_outputs = st.protected_until_outputs
            r.first_scheduled_time = st.first_scheduled_time
            r.first_token_time = st.first_token_time
            r.prompt_logprobs_next = max(r.prompt_logprobs_next, st.prompt_logprobs_next)
            members.append(r)
        for st, leader in zip(samples, members):
            if st is not None and leader is not None:
                leader.pending_children = [c for j in st.pending if (c := members[j]) is not None]
        forked = {id(c) for m in members if m is not None for c in m.pending_children}
        for st, member in zip(samples, members):
            if st is None or member is None:
                continue
            self.kv.give(member, list(st.block_ids), add_reference=True)
            if id(member) not in forked:
                self.scheduler.adopt(member)
        self._groups[req.request_id] = [None if m is None else m.request_id for m in members]
        self._incarnations[req.request_id] = req.incarnation

    def incarnation(self, request_id: str) -> int | None:
        return self._incarnations.get(request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._stop_awaiting(rid)
            ids = self._groups.pop(rid, None)
            self._incarnations.pop(rid, None)
            if ids is not None:
                self._end(ids, RequestStatus.FINISHED_ABORTED)

    def _stop_awaiting(self, request_id: str) -> tuple[EngineCoreRequest, Future[Any]] | None:
        """Take a request out of the grammar wait (its compile is dropped if nobody else waits)."""
        awaiting = self._awaiting_grammar.pop(request_id, None)
        if awaiting is not None and awaiting[0].params.structured_outputs is not None:
            self.structured.release(request_id, awaiting[0].params.structured_outputs)
        return awaiting

    def stop_sample(self, request_id: str, index: int, reason: str) -> None:
        """End one sample because the front end found a stop string in its text."""
        ids = self._groups.get(request_id)
        if ids is None or not 0 <= index < len(ids):
            return
        self._end([ids[index]], RequestStatus.FINISHED_STOPPED, reason)
        self._forget_group(request_id)

    def _end(self, ids: list[str | None], status: RequestStatus, reason: str | None = None) -> None:
        """Finish these samples (None: one that ended before this engine had it)."""
        live = [i for i in ids if i is not None]
        self.scheduler.finish_requests(live, status, reason)
        self.structured.forget(live)
        if self.spec is not None:
            for i in live:
                self.spec.forget(i)

    def fail_requests(self, request_ids: list[str], message: str) -> list[SampleOutput]:
        """End user requests with an error (every sample): the outputs that tell the front end."""
        out = []
        for rid in request_ids:
            awaiting = self._stop_awaiting(rid)
            if awaiting is not None:
                out += [
                    SampleOutput(rid, i, [], None, "error", None, error=message, incarnation=awaiting[0].incarnation)
                    for i in range(awaiting[0].params.n)
                ]
                continue
            ids = self._groups.pop(rid, None)
            if ids is None:
                continue
            self._end(ids, RequestStatus.FINISHED_ERROR, message)
            self.counters.num_request_faults += 1
            run = self._incarnations.pop(rid, 0)
            out += [
                SampleOutput(rid, i, [], None, "error", None, error=message, incarnation=run)
                for i in range(len(ids))
            ]
        return out

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._awaiting_grammar)
            or self._in_flight is not None
            or bool(self._held)
        )

    def _admit_compiled(self) -> list[SampleOutput]:
        """Admit the requests whose grammar has compiled; fail those whose grammar did not."""
        if not self.scheduler.has_unfinished():
            wait([f for _, f in self._awaiting_grammar.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        out: list[SampleOutput] = []
        for rid, (req, fut) in list(self._awaiting_grammar.items()):
            if not fut.done():
                continue
            del self._awaiting_grammar[rid]
            sp = req.params.structured_outputs
            try:
                if sp is None:
                    raise RuntimeError("a request awaits a grammar it does not have")
                self.structured.grammar(sp)  # into the cache; raises the compile's error
                self._admit(req)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"
                logger.error("request %s refused: %s", rid, message)
                out += [
                    SampleOutput(rid, i, [], None, "error", None, error=message, incarnation=req.incarnation)
                    for i in range(req.params.n)
                ]
        return out

    def step(self) -> list[SampleOutput]:
        refused = self._admit_compiled() if self._awaiting_grammar else []
        out = self._step_overlapped() if self.overlap else self._step()
        return refused + out if refused else out

    def _step_overlapped(self) -> list[SampleOutput]:
        """Plan and launch step N+1, then collect step N (in flight since the last call): the
        host's planning runs while the device computes N. A step `sync_reason` names runs the
        synchronous way, after N is collected."""
        start = time.perf_counter()
        began = time.monotonic() if self.step_trace is not None else 0.0
        sched = self.scheduler.schedule()
        prev, self._in_flight = self._in_flight, None
        out, self._held = self._held, []
        reason = sync_reason(sched)
        if reason is None:
            try:
                handle = self.runner.launch(sched, None if prev is None else prev.handle)
            except Exception:
                reason = FAULT  # collected below, then run (and bisected) the synchronous way
        if prev is not None:
            # Timed from this call's start: the loop's period, so the steps' seconds add up to the
            # run's (timed from its own launch, each step would also count the one after it).
            prev.start, prev.began = start, began
        if reason is not None:
            self.overlap_sync_steps[reason] = self.overlap_sync_steps.get(reason, 0) + 1
            if prev is not None:
                out += self._step(in_flight=prev)
                sched = without_finished(sched)
            return out + self._step(sched)
        self.overlap_steps += 1
        self.structured.forget(sched.finished_ids)
        if prev is not None:
            out += self._step(in_flight=prev)
        self._in_flight = InFlight(sched, handle, self.scheduler.advance(sched), start, began)
        return out

    def _collect_in_flight(self) -> None:
        """Collect the step in flight now (its outputs go out with the next step's): before a move
        reads a request's tokens or pauses it."""
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            self._held += self._step(in_flight=prev)

    def _step(self, planned: SchedulerOutput | None = None, in_flight: InFlight | None = None) -> list[SampleOutput]:
        """One synchronous step (of `planned`, or of a plan made now), or the collection of a step
        launched ahead (`in_flight`)."""
        start = time.perf_counter()
        tracing = self.step_trace is not None
        began = time.monotonic() if tracing else 0.0  # the trace's clock: comparable across processes
        if in_flight is not None:
            sched, start, began = in_flight.sched, in_flight.start, in_flight.began
        else:
            sched = self.scheduler.schedule() if planned is None else planned
        shape = shape_of(sched) if tracing else None
        self.structured.forget(sched.finished_ids)
        if in_flight is not None:
            before = {r.request_id: r.num_tokens - r.num_placeholders for r in in_flight.placed}
            result = self.runner.collect(in_flight.handle)
        else:
            before = {r.request_id: r.num_tokens for r in sched.requests}
            try:
                result = self.runner.execute(sched)
            except Exception as exc:
                return self._isolate_fault(sched, exc)
        self._faulted_steps = 0
        if sched.is_empty:
            return []
        if in_flight is not None:
            changed = self.scheduler.resolve(in_flight.placed, result)
        else:
            changed = self.scheduler.update(sched, result)
        if result.prompt_logprobs:
            # Prompt chunks that sampled nothing still hand their prompt logprobs out now.
            listed = {id(r) for r in changed}
            changed += [
                r for r in sched.requests if r.request_id in result.prompt_logprobs and id(r) not in listed
            ]
            for r in sched.requests:
                got = result.prompt_logprobs.get(r.request_id)
                if got is not None:
                    r.prompt_logprobs_next = got[0] + len(got[1])
        update_seconds = time.perf_counter() - start
        out = [self._sample_output(req, before, result) for req in changed]
        # Only once every output has its incarnation: samples finishing together share the group entry.
        for req in changed:
            if req.is_finished:
                self._forget(req)
                self.structured.forget([req.request_id])
        elapsed = time.perf_counter() - start
        if self.step_trace is not None and shape is not None:
            arrivals = [
                r.arrival_time for r in sched.requests
                if r.first_scheduled_time is not None and r.first_scheduled_time >= began
            ]
            # One entry per user request (its first sample): what a replay sets its own against.
            leaders = [r for r in changed if r.sample_index == 0]
            first = [
                r.group_id for r in leaders
                if 0 < r.num_output_tokens == r.num_tokens - before.get(r.request_id, r.num_prompt_tokens)
            ]
            done = [(r.group_id, r.num_output_tokens) for r in leaders if r.is_finished]
            # Timed on the trace's own clock from `began`: `start` is read apart from it, and a
            # process descheduled between the two reads would end this step after the next began.
            seconds = time.monotonic() - began
            self.step_trace.record(began, seconds, shape, self.scheduler.num_waiting, arrivals, first, done)
        generated = sum(len(so.new_token_ids) for so in out)
        self._count_step(sched, result, generated, elapsed)
        if self.spec is not None:
            self.spec.observe_step(sched, result, generated, elapsed, update_seconds)
        return out

    def _sample_output(self, req: Request, before: dict[str, int], result: RunnerOutput) -> SampleOutput:
        """The tokens a request gained this step; a finished request's outcome, and its state dropped."""
        new = req.token_ids[before.get(req.request_id, req.num_prompt_tokens) :]
        lps = result.logprobs.get(req.request_id)
        so = SampleOutput(
            request_id=req.group_id,
            index=req.sample_index,
            new_token_ids=new,
            new_logprobs=None if lps is None else lps[: len(new)],
            incarnation=self._incarnations.get(req.group_id, 0),
        )
        prompt_lps = result.prompt_logprobs.get(req.request_id)
        if prompt_lps is not None:
            so.prompt_logprobs_start, so.prompt_logprobs = prompt_lps
        if req.is_finished:
            so.finish_reason = req.status.finish_reason
            so.stop_reason = req.stop_reason
            so.num_cached_tokens = req.num_cached_tokens
            so.num_preemptions = req.num_preemptions
            so.first_scheduled_time = req.first_scheduled_time
            so.first_token_time = req.first_token_time
            so.finished_time = req.finished_time
            if self.spec is not None:
                self.spec.forget(req.request_id)
        elif req.num_output_tokens == len(new):
            so.num_cached_tokens = req.num_cached_tokens
            so.first_scheduled_time = req.first_scheduled_time
            so.first_token_time = req.first_token_time
        return so

    def _count_step(
        self, sched: SchedulerOutput, result: RunnerOutput, generated: int, seconds: float
    ) -> None:
        c = self.counters
        c.engine_steps += 1
        c.num_batched_tokens += sched.total_tokens
        bump(c.iteration_tokens, sched.total_tokens)
        c.generation_tokens += generated
        c.engine_step_seconds += seconds
        c.engine_forward_seconds += result.forward_time
        c.engine_draft_seconds += result.draft_time

    def snapshot(self) -> dict[str, Any]:
        """The gauges (running and waiting requests, KV usage), every counter under its own name
        (tandem/core/stats.py) and the figures derived from them: `LLM.get_stats()`."""
        out: dict[str, Any] = {
            "num_requests_running": self.scheduler.num_in_flight,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": self.kv.usage,
        }
        out.update(self.counters.as_dict())
        out.update({name: getattr(self.counters, name) for name in DERIVED})
        return out

    def _forget(self, req: Request) -> None:
        self._forget_group(req.group_id)

    def _forget_group(self, group_id: str) -> None:
        """Drop a user request's entry once none of its samples is left in the scheduler."""
        ids = self._groups.get(group_id)
        if ids is not None and all(i is None or self.scheduler.requests.get(i) is None for i in ids):
            del self._groups[group_id]
            self._incarnations.pop(group_id, None)

    # -- the KV plane's host (tandem.kvtransfer.host.KVHost) -----------------------

    def pause(self, req: Request) -> None:
        self._collect_in_flight()
        self.scheduler.pause(req)

    def unpause(self, req: Request) -> None:
        self.scheduler.unpause(req)

    def admission_error(self, req: EngineCoreRequest) -> str | None:
        try:
            self.limits.check(req.prompt_token_ids, req.max_tokens, req.params.n, req.params.stop_ids)
        except ValueError as exc:
            return str(exc)
        return None

    def reserve_seats(self, n: int) -> bool:
        sched = self.scheduler
        if sched.seats_taken + n > sched.max_num_seqs:
            return False
        sched.reserved_seats += n
        return True

    def release_seats(self, n: int) -> None:
        self.scheduler.reserved_seats -= n

    def reserve_blocks(self, n: int) -> list[int] | None:
        return self.kv.take_blocks(n)

    def hold_blocks(self, block_ids: list[int]) -> None:
        self.kv.hold(block_ids)

    def drop_blocks(self, block_ids: list[int]) -> None:
        self.kv.drop(block_ids)

    def read_blocks(self, block_ids: list[int]) -> Any:
        import torch

        data = self.runner.read_blocks(block_ids)
        # As a numpy array of bytes (a buffer the transport sends without a copy): bfloat16 has no
        # numpy dtype.
        return data.reshape(-1).view(torch.uint8).numpy()

    def write_blocks(self, block_ids: list[int], payload: memoryview) -> None:
        self.runner.write_blocks(block_ids, payload)

    # -- faults ----------------------------------------------------------------

    def _isolate_fault(self, sched: SchedulerOutput, exc: Exception) -> list[SampleOutput]:
        """A step raised: find the request(s) whose computation fails on their own, fail those alone,
        and leave the rest to be computed again by the next step (the failed step changed no token
        count, and rewriting the same KV slots is harmless). A fault no single request carries
        (every one passes alone), or that every request in a batch carries, or one that keeps
        recurring, is the engine's own: it is raised."""
        self._faulted_steps += 1
        if sched.is_empty or self._faulted_steps > MAX_FAULTED_STEPS:
            raise exc
        everyone = list(range(len(sched.requests)))
        culprits = {0: exc} if len(everyone) == 1 else self._bisect(sched, everyone)
        if not culprits or (len(culprits) == len(everyone) > 1):
            raise exc
        self.runner.forget_drafts([r.request_id for r in sched.requests])
        out = []
        for i, err in culprits.items():
            group = sched.requests[i].group_id
            logger.error("request %s failed in the engine: %s: %s", group, type(err).__name__, err)
            out += self.fail_requests([group], f"{type(err).__name__}: {err}")
        return out

    def _bisect(self, sched: SchedulerOutput, rows: list[int]) -> dict[int, Exception]:
        """The requests among `rows` (indices into the step) whose part of the step fails, with the
        error each raised: halves that fail are split again, down to single requests."""
        if len(rows) == 1:
            err = self._probe(sched, rows)
            return {} if err is None else {rows[0]: err}
        mid = len(rows) // 2
        out: dict[int, Exception] = {}
        for half in (rows[:mid], rows[mid:]):
            if len(half) == 1 or self._probe(sched, half) is not None:
                out.update(self._bisect(sched, half))
        return out

    def _probe(self, sched: SchedulerOutput, rows: list[int]) -> Exception | None:
        """Run the step's work for a subset of its requests; the error it raises, or None."""
        reqs = [sched.requests[i] for i in rows]
        ids = {r.request_id for r in reqs}
        sub = SchedulerOutput(
            requests=reqs,
            num_tokens=[sched.num_tokens[i] for i in rows],
            block_copies=sched.block_copies,
            num_draft={k: v for k, v in sched.num_draft.items() if k in ids},
            draft_tokens={k: v for k, v in sched.draft_tokens.items() if k in ids},
        )
        try:
            self.runner.execute(sub)
        except Exception as exc:
            return exc
        return None
