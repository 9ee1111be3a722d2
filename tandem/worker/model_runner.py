"""Turns a SchedulerOutput into one flat forward pass and sampled (or verified) tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.core.request import Request
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.model.kv_quant import KVCacheFormat
from tandem.model.loader import auto_dtype, load_model, resolve_dtype
from tandem.sampling_params import SamplingParams
from tandem.spec.config import SpeculativeConfig
from tandem.worker import prompt_logprobs
from tandem.worker.batch import SampleRow, build_batch, to_device
from tandem.worker.cuda_graphs import DecodeGraphs, capture_sizes, graph_step
from tandem.worker.device import GRAPHS_CAPTURE, GRAPHS_OFF, GRAPHS_PADDED, DevicePlan, resolve_device_plan
from tandem.worker.drafter import Drafter
from tandem.worker.gpu_memory import CudaMemoryProbe, KVBudget, MemoryProbe, graph_reserve, size_kv_cache
from tandem.worker.head_drafter import HeadDrafter
from tandem.worker.sampler import PenaltyState, Sampler, SamplingBatch
from tandem.worker.step_handle import StepHandle, placeholder_inputs
from tandem.worker.token_mask import GrammarHook, token_mask
from tandem.worker.tree_verify import compact_accepted, lay_out_trees, path_history, verify_trees

logger = logging.getLogger("tandem.worker")


def position_seed(seed: int, position: int) -> int:
    """The generator seed for sampling the token at `position` of a request seeded with `seed`."""
    return (seed ^ (position * 0x9E3779B97F4A7C15)) & 0x7FFF_FFFF_FFFF_FFFF


def dead_rows(sb: SamplingBatch) -> list[bool] | None:
    """Rows whose hard constraints (allowed_token_ids and bad_words, the grammar) forbid every
    token, or None if there are none. Their masks are lifted, so the row's arithmetic stays finite:
    whatever it draws is dropped (`end_dead`)."""
    masks = [m for m in (sb.blocked, sb.grammar_forbidden) if m is not None]
    if not masks:
        return None
    dead = masks[0].all(dim=-1) if len(masks) == 1 else (masks[0] | masks[1]).all(dim=-1)
    if not bool(dead.any()):
        return None
    for m in masks:
        m[dead] = False
    return dead.tolist()


def blocked_word_ends(req: Request, history: list[int], words: list[list[int]]) -> list[int]:
    """The last tokens of the bad words whose other tokens end the output (drafts `history`
    included): those the next position may not take. Reads only the output's last tokens, as many
    as the longest word needs, not the whole output."""
    num_out = req.num_output_tokens + len(history)
    need = max(len(w) for w in words) - 1
    tail: list[int] = []
    if need:
        start = max(req.num_prompt_tokens, req.num_tokens - need)
        tail = (req.token_ids[start:] + history)[-need:]
    return [
        w[-1]
        for w in words
        if len(w) - 1 <= num_out and (len(w) == 1 or tail[len(tail) - len(w) + 1 :] == w[:-1])
    ]


def end_dead(dead: list[bool], used_rows: dict[str, list[int]], out: RunnerOutput) -> None:
    """Samples that reach a dead row end there: the drafts accepted before it stay, nothing after.
    used_rows: per sample, the row each token it emitted came from (its accepted drafts', then the
    last one's)."""
    for rid, rows in used_rows.items():
        stop = next((j for j, row in enumerate(rows) if dead[row]), None)
        accepted = out.accepted.get(rid, [])
        if stop is None:
            continue
        out.dead_ends.add(rid)
        if stop:
            out.accepted[rid] = accepted[:stop]
        else:
            out.accepted.pop(rid, None)
        if rid in out.logprobs:
            out.logprobs[rid] = out.logprobs[rid][:stop]


class ModelRunner:
    # The penalties' per-request state, made on first use from the vocabulary and device alone.
    _penalty_state: PenaltyState | None = None
    # Decode batches through static buffers (CUDA graphs, or padded eagerly on a CPU); None: off.
    graphs: DecodeGraphs | None = None
    # How the KV cache was sized from GPU memory (None where the blocks were given).
    kv_budget: KVBudget | None = None
    # Why capturing the decode graphs failed, where it did (the engine then runs them eagerly).
    graph_error: str | None = None

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        num_blocks: int | None,
        max_model_len: int,
        device: str | torch.device | None = None,
        draft_model_config: ModelConfig | None = None,
        plan: DevicePlan | None = None,
        memory_probe: MemoryProbe | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        """`plan` (tandem/worker/device.py): where and how to run; None resolves it from
        `engine_config` (with `device`, where given, in place of its device). `num_blocks` None:
        size the KV cache from the GPU's memory (`gpu_memory_utilization`), measured through
        `memory_probe` (torch.cuda's figures on CUDA; tests pass a fake)."""
        if plan is None:
            cfg = engine_config
            if device is not None:
                cfg = replace(engine_config, device=torch.device(device).type)
            plan = resolve_device_plan(cfg, graph_safe=model_config.moe is None)
        self.plan = plan
        self.device = torch.device(plan.device)
        self.model_config = model_config
        self.block_size = engine_config.block_size
        self.dtype = resolve_dtype(engine_config.dtype, self.device)
        if engine_config.dtype == "auto":
            logger.info("dtype auto: %s (%s)", *auto_dtype(self.device))
        logger.info(
            "%s; attention %s; linear layers: %s; decode batches: %s",
            plan.reason or f"device {plan.device}",
            plan.attention_backend,
            "Tandem's CPU paths" if plan.cpu_kernels else "torch",
            {GRAPHS_CAPTURE: "CUDA graphs", GRAPHS_PADDED: "padded static buffers (eager)"}.get(
                plan.decode_graphs, "eager"
            ),
        )
        # How the KV cache stores K and V (the draft model's cache too).
        self.kv_format = KVCacheFormat(engine_config.kv_cache_dtype, self.dtype)
        probe = memory_probe
        if num_blocks is None and probe is None:
            if self.device.type != "cuda":
                raise ValueError("the KV cache's size must be given (num_blocks) off CUDA")
            probe = CudaMemoryProbe(self.device)
        start = None
        if num_blocks is None:
            assert probe is not None
            start = (*probe.free_and_total(), probe.allocated())
        self.model = load_model(
            model_config,
            self.dtype,
            self.device,
            plan.attention_backend,
            max_model_len,
            engine_config.quantization,
            engine_config.kv_cache_dtype,
            cpu_kernels=plan.cpu_kernels,
            load_format=engine_config.load_format,
            seed=engine_config.seed,
        )
        self.backend = self.model.backend
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(engine_config.seed))
        self.generators: dict[str, torch.Generator] = {}
        self.vocab_size = model_config.vocab_size
        # The engine's structured-output state, where it has any (set by EngineCore).
        self.grammar: GrammarHook | None = None
        self.drafter = None
        if draft_model_config is not None:
            self.drafter = Drafter(self, draft_model_config, engine_config, max_model_len)
        sizes: list[int] = []
        if plan.decode_graphs != GRAPHS_OFF:
            sizes = capture_sizes(engine_config.max_num_seqs, engine_config.max_num_batched_tokens)
        if num_blocks is None:
            assert probe is not None and start is not None
            num_blocks = self._size_kv(probe, start, engine_config, max_model_len, sizes[-1] if sizes else 0)
        self.num_blocks = num_blocks
        # With decode graphs, one more block than the KV manager hands out: the padding rows'.
        self.kv_caches = self.allocate_kv(model_config, num_blocks + (1 if sizes else 0))
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)
        # EAGLE / Medusa: draft trees from heads over the target's own features.
        self.head_drafter: HeadDrafter | None = None
        if speculative_config is not None and speculative_config.uses_head:
            self.head_drafter = HeadDrafter(
                self, self.model, model_config, speculative_config, engine_config, num_blocks, max_model_len
            )
        if sizes:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                sizes,
                self.block_size,
                max_model_len,
                pad_block=num_blocks,
                device=self.device,
                capture=plan.decode_graphs == GRAPHS_CAPTURE,
            )
            t0 = time.perf_counter()
            try:
                self.graphs.capture()
            except RuntimeError as exc:
                # Serving eagerly beats not serving; the `gpu`-marked tests fail on this path.
                logger.warning("CUDA graph capture failed, decode batches run eagerly: %s", exc)
                self.graphs = None
                self.graph_error = str(exc)
            if self.graphs is not None and plan.decode_graphs == GRAPHS_CAPTURE:
                logger.info(
                    "CUDA graphs: %d decode batch sizes (1 to %d) captured in %.1f s",
                    len(sizes),
                    sizes[-1],
                    time.perf_counter() - t0,
                )

    def _size_kv(
        self,
        probe: MemoryProbe,
        start: tuple[int, int, int],
        config: EngineConfig,
        max_model_len: int,
        graph_rows: int,
    ) -> int:
        """KV blocks from the GPU's memory: what gpu_memory_utilization leaves after the weights,
        a profiled peak and the rest (tandem/worker/gpu_memory.py). Logs the arithmetic."""
        free0, total, allocated0 = start
        weights = probe.allocated() - allocated0
        tokens = min(config.max_num_batched_tokens, max_model_len)
        rows = min(config.max_num_seqs, tokens)
        probe.reset_peak()
        base = probe.allocated()
        scratch_kv = self.profile_pass(tokens, rows)
        peak = max(0, probe.peak_allocated() - base - scratch_kv)
        free_now, _ = probe.free_and_total()
        non_torch = max(0, (total - free_now) - (total - free0) - probe.reserved())
        per_block = self.kv_bytes_per_block(self.model_config, self.block_size, self.kv_format)
        if self.drafter is not None:
            per_block += self.kv_bytes_per_block(self.drafter.model_config, self.block_size, self.kv_format)
        self.kv_budget = size_kv_cache(
            total_bytes=total,
            free_at_start_bytes=free0,
            utilization=config.gpu_memory_utilization,
            weights_bytes=weights,
            activation_peak_bytes=peak,
            non_torch_bytes=non_torch,
            block_bytes=per_block,
            graph_reserve_bytes=graph_reserve(
                peak, graph_rows, tokens, graph_rows * self.vocab_size * self.dtype.itemsize
            ),
        )
        # One more block for the decode graphs' padding rows comes out of what is left.
        num_blocks = self.kv_budget.num_blocks - (1 if graph_rows else 0)
        if num_blocks < 1:
            raise ValueError("gpu_memory_utilization leaves no room for the KV cache")
        logger.info(self.kv_budget.describe(self.block_size))
        if num_blocks * self.block_size < max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len (%d): a longest request will "
                "not fit (raise gpu_memory_utilization or lower max_model_len)",
                num_blocks * self.block_size,
                max_model_len,
            )
        return num_blocks

    @torch.inference_mode()
    def profile_pass(self, tokens: int, rows: int) -> int:
        """The largest step the scheduler can make, for its peak memory: `tokens` tokens over `rows`
        requests (a temporary KV cache just large enough, freed after), their logits and a sampling
        pass with top-k and top-p (the sort is the sampler's largest temporary). Returns the
        temporary cache's bytes (not activations: the caller takes them off the peak)."""
        bs = self.block_size
        per = [tokens // rows + (1 if i < tokens % rows else 0) for i in range(rows)]
        reqs, next_block = [], 0
        for i, n in enumerate(per):
            need = -(-n // bs)
            sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
            r = Request(f"profile-{i}", [0] * n, sampling, max_tokens=1)
            r.block_ids = list(range(next_block, next_block + need))
            next_block += need
            reqs.append(r)
        caches = self.allocate_kv(self.model_config, next_block)
        batch, ends = build_batch(reqs, per, bs, self.device)
        batch.logits_indices = torch.from_numpy(ends - 1).to(self.device)
        self.backend.prepare(batch)
        hidden = self.model(batch, caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        self.sampler(logits, self.sampling_batch([SampleRow(r, []) for r in reqs]))
        scratch = sum(c.numel() * c.element_size() for c in caches)
        del caches, hidden, logits
        return scratch

    def warm(self, max_rows: int) -> None:
        """Build oneDNN's per-row-count primitives for batches of up to `max_rows` rows now, not in
        the first step of each batch size (see `warm_row_counts`)."""
        if self.device.type != "cpu":
            return
        from tandem.model.linear import warm_row_counts
        from tandem.model.loader import model_module

        for model in [self.model] + ([self.drafter.model] if self.drafter is not None else []):
            warm_row_counts(model_module(model), range(1, max_rows + 1))
        if self.head_drafter is not None:  # a head's passes are as few rows as a step's
            warm_row_counts(self.head_drafter.head, range(1, max_rows + 1))

    @torch.inference_mode()
    def time_passes(
        self, shapes: list[tuple[int, int]], context: int, draft: bool = False, repeats: int = 3
    ) -> list[float]:
        """Seconds (best of `repeats`) of one pass per `(requests, tokens each)` shape over a synthetic
        batch whose requests have `context` tokens before: building the batch and its attention
        metadata, the forward, logits for every token and their argmax, as a verification step (or,
        with `draft`, a draft-model proposal pass) computes them. The passes write KV into blocks
        no request holds yet, so this runs before serving. Raises ValueError if the cache is too
        small for the shapes."""
        if not draft:
            model, caches, backend = self.model, self.kv_caches, self.backend
        elif self.drafter is not None:
            model, caches, backend = self.drafter.model, self.drafter.kv_caches, self.drafter.backend
        else:
            raise ValueError("draft=True needs a draft model")
        longest = context + max(q for _, q in shapes)
        blocks = list(range(-(-longest // self.block_size)))
        if len(blocks) > caches[0].shape[1]:
            raise ValueError(f"a {longest}-token pass needs more KV blocks than the cache has")
        out = []
        for num_reqs, q_len in shapes:
            reqs = []
            for i in range(num_reqs):
                r = Request(f"timing-{i}", [1] * (context + q_len), SamplingParams(), max_tokens=1)
                r.block_ids, r.num_computed_tokens = blocks, context
                reqs.append(r)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                batch, _ = build_batch(reqs, [q_len] * num_reqs, self.block_size, self.device)
                backend.prepare(batch)
                hidden = model(batch, caches)
                model.compute_logits(hidden).argmax(dim=-1).tolist()
                best = min(best, time.perf_counter() - start)
            out.append(best)
        return out

    def allocate_kv(self, mc: ModelConfig, num_blocks: int) -> list[torch.Tensor]:
        """Per layer `[2, num_blocks, block_size, kv_heads, row]`: row = head_dim in the model dtype,
        or a quantized row with its scale (tandem/model/kv_quant.py)."""
        fmt, bs = self.kv_format, self.block_size
        return [
            fmt.allocate(num_blocks, bs, mc.num_kv_heads, mc.head_dim, self.device) for _ in range(mc.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model_config: ModelConfig, block_size: int, kv_format: KVCacheFormat) -> int:
        """Bytes of one block in every layer, K and V, scales included."""
        rows = 2 * model_config.num_layers * model_config.num_kv_heads * block_size
        return rows * kv_format.row_bytes(model_config.head_dim)

    # -- preemption by swap: KV blocks to and from host memory ------------------

    # The swap space: per cache indexed by block ids (`block_caches`), one host tensor
    # `[num_swap_blocks, layers, 2, block_size, kv_heads, row]` in that cache's storage dtype, in host
    # memory (pinned when the caches are on a GPU, so the copies run as DMA); None: no swap.
    swap_space: list[torch.Tensor] | None = None

    def block_caches(self) -> list[list[torch.Tensor]]:
        """Every KV cache the block ids index: the target's, and a draft model's or draft heads'."""
        out = [self.kv_caches]
        if self.drafter is not None:
            out.append(self.drafter.kv_caches)
        if self.head_drafter is not None:  # its KV (EAGLE) and the target's features it keeps
            out.extend(self.head_drafter.block_caches())
        return out

    def swap_block_bytes(self) -> int:
        """Bytes one swapped block takes in host memory: one block of every layer of every cache (K
        and V, a quantized row's scale included: the caches' raw rows are copied as they are)."""
        return sum(len(c) * c[0][:, 0].numel() * c[0].element_size() for c in self.block_caches())

    def allocate_swap(self, num_bytes: int) -> int:
        """Make a swap space of at most `num_bytes` bytes; returns its number of host blocks."""
        num_swap_blocks = num_bytes // self.swap_block_bytes()
        if num_swap_blocks <= 0:
            self.swap_space = None
            return 0
        pin = self.device.type == "cuda"
        self.swap_space = [
            torch.empty(
                (num_swap_blocks, len(c), c[0].shape[0], *c[0].shape[2:]),
                dtype=c[0].dtype,
                device="cpu",
                pin_memory=pin,
            )
            for c in self.block_caches()
        ]
        return num_swap_blocks

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host blocks, `(device, host)` pairs."""
        if self.swap_space is None:
            raise RuntimeError("swap-out planned without a swap space")
        ids = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=self.device)
        non_blocking = self.device.type == "cuda"
        for caches, host in zip(self.block_caches(), self.swap_space):
            # [layers, 2, n, ...] -> [n, layers, 2, ...]: each block contiguous, one copy per host block.
            blocks = torch.stack([cache.index_select(1, ids) for cache in caches]).movedim(2, 0).contiguous()
            for i, (_, h) in enumerate(pairs):
                host[h].copy_(blocks[i], non_blocking=non_blocking)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back into device blocks, `(host, device)` pairs."""
        if self.swap_space is None:
            raise RuntimeError("swap-in planned without a swap space")
        ids = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        non_blocking = self.device.type == "cuda"
        for caches, host in zip(self.block_caches(), self.swap_space):
            staged = torch.empty((len(pairs), *host.shape[1:]), dtype=host.dtype, device=self.device)
            for i, (h, _) in enumerate(pairs):
                staged[i].copy_(host[h], non_blocking=non_blocking)
            for layer, cache in enumerate(caches):
                cache.index_copy_(1, ids, staged[:, layer].movedim(0, 1))

    # -- moving KV between instances -----------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks' KV in every layer, one contiguous tensor
        `(layers, 2, len(block_ids), block_size, kv_heads, row)` in the cache's storage dtype (a
        quantized row carries its scale; the draft model's KV is not included: a receiving drafter
        catches up on its own)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([cache.index_select(1, ids) for cache in self.kv_caches])

    def write_blocks(self, block_ids: list[int], data: memoryview) -> None:
        """Write KV that `read_blocks` produced (on another instance, as bytes) into these blocks."""
        import warnings

        cache = self.kv_caches[0]
        shape = (len(self.kv_caches), 2, len(block_ids), *cache.shape[2:])
        expected = self.kv_bytes_per_block(self.model_config, self.block_size, self.kv_format) * len(block_ids)
        if data.nbytes != expected:
            raise ValueError(
                f"KV payload of {data.nbytes} bytes for {len(block_ids)} blocks (expected {expected})"
            )
        if not block_ids:
            return
        with warnings.catch_warnings():  # a received buffer is read-only; it is only read from
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=self.kv_format.storage_dtype).view(shape)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, dst in enumerate(self.kv_caches):
            dst.index_copy_(1, ids, src[layer].to(self.device))

    @property
    def penalty_state(self) -> PenaltyState:
        if self._penalty_state is None:
            self._penalty_state = PenaltyState(self.vocab_size, self.device)
        return self._penalty_state

    def forget_drafts(self, request_ids: list[str]) -> None:
        """The draft KV of these requests is no longer trusted (a step over them failed part-way):
        their next proposal feeds the draft from the start."""
        if self.drafter is not None:
            for rid in request_ids:
                self.drafter.valid.pop(rid, None)
        if self.head_drafter is not None:
            self.head_drafter.forget(request_ids)

    # -- one step --------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for rid in sched.finished_ids:
            self.generators.pop(rid, None)
        if self._penalty_state is not None:
            self._penalty_state.forget(sched.finished_ids)
        if self.drafter is not None:
            self.drafter.sync(sched.requests, sched.preempted, sched.finished_ids)
        heads = self.head_drafter
        if heads is not None:
            heads.sync(sched.requests, sched.preempted, sched.finished_ids)
        # Swap-outs first (their device blocks may be reused this step), then copy-on-write (a source
        # may be a block freed this step and handed to a swap-in), then swap-ins.
        if sched.swap_out:
            self.swap_out(sched.swap_out)
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        if sched.swap_in:
            self.swap_in(sched.swap_in)
        if sched.is_empty:
            return RunnerOutput()
        out = RunnerOutput()
        drafts = dict(sched.draft_tokens)
        draft_probs: dict[str, torch.Tensor] = {}
        if self.drafter is not None and sched.num_draft:
            todo = [
                (r, sched.num_draft[r.request_id])
                for r in sched.requests
                if sched.num_draft.get(r.request_id)
            ]
            proposed, draft_probs, out.draft_passes = self.drafter.propose(todo)
            drafts.update(proposed)
        if heads is not None and sched.num_draft:
            todo = [(r, k) for r in sched.requests if (k := sched.num_draft.get(r.request_id, 0))]
            for rid, head_tree in heads.propose(todo).items():
                drafts[rid] = list(head_tree.tokens)
                if not head_tree.is_chain:  # verified as a tree, like the scheduler's (suffix) trees
                    sched.draft_trees[rid] = head_tree
            out.draft_passes = heads.passes  # timed: the controller prices head passes per depth

        trees = sched.draft_trees
        graphs = self.graphs
        # A head drafter reads every step's hidden states, which a graph replay does not return.
        if (
            heads is None
            and graphs is not None
            and graph_step(sched.requests, sched.num_tokens, bool(drafts or trees), graphs.sizes[-1])
        ):
            t0 = time.perf_counter()
            logits = graphs.run(sched.requests)
            out.forward_time = time.perf_counter() - t0  # on CUDA: until the replay is queued
            decode_rows = [SampleRow(req, []) for req in sched.requests]
            decode_spans = [(req, i, 0) for i, req in enumerate(sched.requests)]
            return self._sample(logits, decode_rows, decode_spans, sched, drafts, draft_probs, out)
        batch, ends = build_batch(sched.requests, sched.num_tokens, self.block_size, self.device, drafts)
        if trees:
            lay_out_trees(batch, sched.requests, ends, trees)
        rows: list[SampleRow] = []
        logits_rows: list[int] = []
        spans: list[tuple[Request, int, int]] = []  # (member, first row, number of drafts)
        for i, req in enumerate(sched.requests):
            end = int(ends[i])
            if req.num_computed_tokens + sched.num_tokens[i] < req.num_tokens:
                continue  # a prompt chunk that does not reach the end: nothing to sample
            d = drafts.get(req.request_id, [])
            tree = trees.get(req.request_id)
            for member in (req, *req.pending_children):
                spans.append((member, len(rows), len(d)))
                for j in range(len(d) + 1):
                    rows.append(SampleRow(member, d[:j] if tree is None else path_history(tree, j)))
                    logits_rows.append(end - 1 - len(d) + j)
        batch.logits_indices = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        self.backend.prepare(batch)
        t0 = time.perf_counter()
        hidden = self.model(batch, self.kv_caches)
        out.forward_time = time.perf_counter() - t0
        if any(r.owes_prompt_logprobs for r in sched.requests):
            t0 = time.perf_counter()
            slices = prompt_logprobs.plan(sched.requests, sched.num_tokens, ends)
            out.prompt_logprobs = prompt_logprobs.compute(slices, hidden, self.model.compute_logits)
            out.forward_time += time.perf_counter() - t0
        if rows:
            t0 = time.perf_counter()
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            out.forward_time += time.perf_counter() - t0
            self._sample(logits, rows, spans, sched, drafts, draft_probs, out)
        if heads is not None:
            heads.capture(sched.requests, batch.slot_mapping, hidden, trees, out, heads.keeps_features(sched))
        return out

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: (src, dst) blocks in every cache."""
        src = to_device([s for s, _ in pairs], torch.long, self.device)
        dst = to_device([d for _, d in pairs], torch.long, self.device)
        for caches in self.block_caches():
            for cache in caches:
                cache[:, dst] = cache[:, src]

    # -- one step launched ahead of the host (overlap scheduling) -------------

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: StepHandle | None) -> StepHandle:
        """Queue a step whose tokens nobody needs on the host before the next step is planned
        (tandem/core/overlap.py's `sync_reason` is None: no drafts, forks, swaps, prompt logprobs,
        grammars, penalties or token masks). Inputs that are placeholders come from
        `prev.tokens` on the device. Nothing is read back here: `collect` does it."""
        for rid in sched.finished_ids:
            self.generators.pop(rid, None)
        if self._penalty_state is not None:
            self._penalty_state.forget(sched.finished_ids)
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        out = RunnerOutput()
        index, offset, src = placeholder_inputs(sched.requests, sched.num_tokens, prev)
        fed = None
        if index:
            assert prev is not None and prev.tokens is not None  # placeholder_inputs checked
            fed = prev.tokens[to_device(src, torch.long, self.device)]
        graphs = self.graphs
        logits: torch.Tensor | None
        t0 = time.perf_counter()
        if graphs is not None and graph_step(sched.requests, sched.num_tokens, False, graphs.sizes[-1]):
            # Every request decodes its last token: a placeholder sits at offset 0 of its own row.
            feed = None if fed is None else (to_device(index, torch.long, self.device), fed)
            logits = graphs.run(sched.requests, feed)
            sampling = list(sched.requests)
        else:
            batch, ends = build_batch(sched.requests, sched.num_tokens, self.block_size, self.device)
            if fed is not None:
                starts = batch.query_start_loc
                flat = [int(starts[i]) + at for i, at in zip(index, offset)]
                batch.input_ids[to_device(flat, torch.long, self.device)] = fed
            sampling, logits_rows = [], []
            for i, req in enumerate(sched.requests):
                if req.num_computed_tokens + sched.num_tokens[i] >= req.num_tokens:
                    sampling.append(req)
                    logits_rows.append(int(ends[i]) - 1)
            batch.logits_indices = to_device(logits_rows, torch.long, self.device)
            self.backend.prepare(batch)
            hidden = self.model(batch, self.kv_caches)
            logits = self.model.compute_logits(hidden[batch.logits_indices]) if sampling else None
        out.forward_time = time.perf_counter() - t0  # on CUDA: until the work is queued
        if logits is None:
            return StepHandle(None, None, None, out=out)
        tokens = self.sampler.sample_tokens(logits, self.sampling_batch([SampleRow(r, []) for r in sampling]))
        num_logprobs = [r.sampling.logprobs for r in sampling]
        lps = None
        if any(k is not None for k in num_logprobs):
            lps = Sampler.logprob_tensors(torch.log_softmax(logits.float(), dim=-1), tokens, num_logprobs)
        ready = None
        if self.device.type == "cuda":

            def to_host(t: torch.Tensor) -> torch.Tensor:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return host.copy_(t, non_blocking=True)

            host = to_host(tokens)
            if lps is not None:
                lps = (to_host(lps[0]), to_host(lps[1]), to_host(lps[2]), to_host(lps[3]))
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = tokens
        rows = {r.request_id: i for i, r in enumerate(sampling)}
        return StepHandle(tokens, host, ready, rows, out, lps, num_logprobs)

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """The launched step's output: waits for its tokens' copy to the host (the step's one
        synchronisation; logprobs, where asked, were copied before the same event)."""
        if handle.host is not None:
            if handle.ready is not None:
                handle.ready.synchronize()
            values = handle.host.tolist()
            handle.out.sampled = {rid: values[row] for rid, row in handle.rows.items()}
            if handle.logprobs is not None:
                lps = Sampler.logprobs_of(handle.logprobs, handle.num_logprobs)
                for rid, row in handle.rows.items():
                    lp = lps[row]
                    if lp is not None:
                        handle.out.logprobs[rid] = [lp]
        return handle.out

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        spans: list[tuple[Request, int, int]],
        sched: SchedulerOutput,
        drafts: dict[str, list[int]],
        draft_probs: dict[str, torch.Tensor],
        out: RunnerOutput,
    ) -> RunnerOutput:
        """Sample (or verify drafts) at the logits rows of a step: one row per `rows` entry."""
        trees = sched.draft_trees
        sb = self.sampling_batch(rows)
        if self.grammar is not None:
            masked = self.grammar.token_bitmask([(r.request, r.history) for r in rows])
            if masked is not None:
                sb.grammar_forbidden = token_mask(*masked, len(rows), logits.shape[1], self.device)
        dead = dead_rows(sb)
        used_rows: dict[str, list[int]] = {}  # per sample: the rows its emitted tokens came from
        paths: dict[str, list[int]] = {}
        if not drafts:
            tokens, logprobs = self.sampler(logits, sb)
            for (member, first, _), tok, lp in zip(spans, tokens, logprobs):
                out.sampled[member.request_id] = tok
                used_rows[member.request_id] = [first]
                if lp is not None:
                    out.logprobs[member.request_id] = [lp]
        else:
            chains = [s for s in spans if s[0].request_id not in trees]
            if chains:
                self._verify(logits, sb, chains, drafts, draft_probs, out, used_rows)
            if trees:
                tree_spans = [(m, first, trees[m.request_id]) for m, first, _ in spans if m.request_id in trees]
                paths = verify_trees(self.sampler, logits, sb, tree_spans, out, used_rows)
        if dead is not None:
            end_dead(dead, used_rows, out)
        if paths:
            compact_accepted(self.kv_caches, sched.requests, paths, out, self.block_size)
        return out

    def _verify(
        self,
        logits: torch.Tensor,
        sb: SamplingBatch,
        spans: list[tuple[Request, int, int]],
        drafts: dict[str, list[int]],
        draft_probs: dict[str, torch.Tensor],
        out: RunnerOutput,
        used_rows: dict[str, list[int]],
    ) -> None:
        logits = logits.float()
        if sb.all_greedy:
            tokens_l, accepted_l = self._verify_greedy(logits, sb, spans, drafts)
        else:
            tokens_l, accepted_l = self._verify_sampled(logits, sb, spans, drafts, draft_probs)
        raw = None
        if any(k is not None for k in sb.num_logprobs):
            raw = torch.log_softmax(logits, dim=-1)
        for b, (member, first, _) in enumerate(spans):
            a = accepted_l[b]
            emitted = tokens_l[b][: a + 1]
            rid = member.request_id
            if a:
                out.accepted[rid] = emitted[:a]
            out.sampled[rid] = emitted[a]
            used_rows[rid] = list(range(first, first + a + 1))
            if raw is not None and member.sampling.logprobs is not None:
                idx = torch.arange(first, first + a + 1, device=raw.device)
                lps = self.sampler.logprobs(
                    raw[idx], torch.tensor(emitted, device=raw.device), [member.sampling.logprobs] * (a + 1)
                )
                out.logprobs[rid] = [lp for lp in lps if lp is not None]

    def _verify_greedy(
        self,
        logits: torch.Tensor,
        sb: SamplingBatch,
        spans: list[tuple[Request, int, int]],
        drafts: dict[str, list[int]],
    ) -> tuple[list[list[int]], list[int]]:
        """All rows greedy: accept while the draft equals the target's argmax (penalties applied).

        The same rule as `rejection_sample` on one-hot targets, without building [B, k+1, V]
        distributions, which at high concurrency cost more than the forward of a tiny model.
        """
        target = self.sampler.greedy_tokens(logits, sb).tolist()
        tokens_l, accepted_l = [], []
        for member, first, k in spans:
            row = target[first : first + k + 1]
            d = drafts.get(member.request_id, [])
            a = 0
            while a < k and d[a] == row[a]:
                a += 1
            tokens_l.append(row)
            accepted_l.append(a)
        return tokens_l, accepted_l

    def _verify_sampled(
        self,
        logits: torch.Tensor,
        sb: SamplingBatch,
        spans: list[tuple[Request, int, int]],
        drafts: dict[str, list[int]],
        draft_probs: dict[str, torch.Tensor],
    ) -> tuple[list[list[int]], list[int]]:
        from tandem.spec.rejection import rejection_sample

        probs = self.sampler.distribution(logits, sb)
        vocab = probs.shape[1]
        num = len(spans)
        k_max = max(k for _, _, k in spans)
        dev = probs.device
        target = torch.zeros(num, k_max + 1, vocab, device=dev)
        # k_max is 0 where every request that drafted verifies a tree (chains hold the rest).
        draft_tok = torch.zeros(num, k_max, dtype=torch.long)
        num_draft = torch.tensor([k for _, _, k in spans], dtype=torch.long)
        q = torch.zeros(num, k_max, vocab, device=dev) if draft_probs else None
        for b, (member, first, k) in enumerate(spans):
            target[b, : k + 1] = probs[first : first + k + 1]
            if k:
                draft_tok[b, :k] = torch.tensor(drafts[member.request_id])
                if q is not None:
                    q[b, :k] = draft_probs[member.request_id][:k]
        greedy = torch.tensor([m.sampling.greedy for m, _, _ in spans])
        gens = [sb.generators[first] for _, first, _ in spans]
        tokens, accepted = rejection_sample(
            target, draft_tok, num_draft, q, greedy, gens, self.sampler.generator
        )
        return tokens.tolist(), accepted.tolist()

    def sampling_batch(self, rows: list[SampleRow]) -> SamplingBatch:
        dev = self.device
        params = [r.request.sampling for r in rows]
        greedy_l = [p.greedy for p in params]
        temperature = to_device([1.0 if g else p.temperature for p, g in zip(params, greedy_l)], torch.float32, dev)
        vocab = self.vocab_size
        top_k = top_p = min_p = None
        if any(p.top_k for p in params):
            top_k = to_device([min(p.top_k, vocab) if p.top_k else vocab for p in params], torch.long, dev)
        if any(p.top_p < 1.0 for p in params):
            top_p = to_device([p.top_p for p in params], torch.float32, dev)
        if any(p.min_p > 0.0 for p in params):
            min_p = to_device([p.min_p for p in params], torch.float32, dev)

        presence = frequency = repetition = counts = prompt_mask = None
        penalized = [p.uses_penalties for p in params]
        if any(penalized):
            presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
            counts, prompt_mask = self.penalty_state.rows([(r.request, r.history) for r in rows], penalized)

        held_stops = None
        for i, row in enumerate(rows):
            r, sp = row.request, row.request.sampling
            if r.num_output_tokens + len(row.history) < sp.min_tokens:
                stops = list(sp.stop_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
                if stops:
                    if held_stops is None:
                        held_stops = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
                    held_stops[i, to_device(stops, torch.long, dev)] = True

        bias = blocked = None
        if any(p.uses_token_controls for p in params):
            bias, blocked = self._token_controls(rows)

        generators: list[torch.Generator | None] = []
        seeded: set[str] = set()
        for row in rows:
            r = row.request
            gen = None
            if r.seed is not None and not r.sampling.greedy:
                gen = self.generators.get(r.request_id)
                if gen is None:
                    gen = self.generators[r.request_id] = torch.Generator(device=dev)
                if r.request_id not in seeded:
                    # Seeded from (seed, position), not run on from the first token: a request resumed
                    # or moved to another instance draws exactly what it would have drawn here.
                    gen.manual_seed(position_seed(r.seed, r.num_tokens))
                    seeded.add(r.request_id)
            generators.append(gen)
        return SamplingBatch(
            temperature=temperature,
            greedy=to_device(greedy_l, torch.bool, dev),
            greedy_rows=greedy_l,
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
            held_stops=held_stops,
            generators=generators,
            num_logprobs=[p.logprobs for p in params],
            bias=bias,
        )

    def _token_controls(self, rows: list[SampleRow]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """logit_bias as an [R, V] bias; allowed_token_ids and bad_words as an [R, V] block."""
        dev, vocab = self.device, self.vocab_size
        bias = blocked = None

        def block() -> torch.Tensor:
            nonlocal blocked
            if blocked is None:
                blocked = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
            return blocked

        for i, row in enumerate(rows):
            sp = row.request.sampling
            if sp.logit_bias:
                if bias is None:
                    bias = torch.zeros(len(rows), vocab, device=dev)
                ids = to_device(list(sp.logit_bias.keys()), torch.long, dev)
                bias[i, ids] = to_device(list(sp.logit_bias.values()), bias.dtype, dev)
            if sp.allowed_token_ids is not None:
                allowed = torch.zeros(vocab, dtype=torch.bool, device=dev)
                allowed[torch.tensor(sp.allowed_token_ids, device=dev)] = True
                block()[i] |= ~allowed
            if sp.bad_words_token_ids:
                last = blocked_word_ends(row.request, row.history, sp.bad_words_token_ids)
                if last:
                    block()[i, torch.tensor(last, device=dev)] = True
        return bias, blocked
