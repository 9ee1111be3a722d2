"""Decode batches through static buffers: CUDA graphs on a GPU, the same padded batches eagerly on
a CPU (the GPU path's logic under the test suite).

At start the runner captures one graph per size of a ladder of batch sizes (1, 2, 4, then every
multiple of 8 up to the largest decode batch the scheduler can make: `max_num_seqs`, within the
step's token budget), each running the model's forward and LM head over the first `size` rows of
static input buffers; the largest is captured first and every graph shares its memory pool. A
decode step of n requests (one new token each, nothing else in the step) fills the first n rows,
pads the rest up to the next captured size and replays that graph; its first n logits rows are
the step's. Padded rows are harmless: token 0 at position 0, a context of one token, writing and
reading a block of their own that no request ever holds (the KV cache has one more block than the
KV manager hands out). Steps with prompt chunks, drafts, trees, prompt logprobs or more requests
than the largest size run eagerly, as does everything with `enforce_eager`.

The attention kernel in a graph cannot look at the batch on the host: the captured layout gives it
`max_model_len` as the longest context (the split-K count is fixed per size), and the tiles past a
request's real length are skipped on the device.

The ladder, the padding and the choice of steps are plain functions (`capture_sizes`,
`padded_size`, `graph_step`), tested on CPU; so is the whole static-buffer path, in `padded`
mode. Only `torch.cuda.graph` capture and replay need a GPU (the `gpu`-marked tests).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import numpy as np
import torch

from tandem.core.request import Request
from tandem.model.forward_batch import ForwardBatch

logger = logging.getLogger("tandem.worker")


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The ladder of decode batch sizes to capture: 1, 2, 4, every multiple of 8, and the largest
    decode batch itself (the smaller of max_num_seqs and the step's token budget)."""
    top = min(max_num_seqs, max_num_batched_tokens)
    if top < 1:
        return []
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size holding n rows; None when n is 0 or past the largest."""
    if n < 1 or not sizes or n > sizes[-1]:
        return None
    return sizes[bisect.bisect_left(sizes, n)]


def graph_step(
    requests: Sequence[Request], num_tokens: Sequence[int], has_drafts: bool, max_size: int
) -> bool:
    """Whether a step is a plain decode batch a graph can run: one token per request, each the
    request's last (so it is sampled), no drafts or trees, no prompt logprobs, no samples forking
    off a leader, at most `max_size` requests."""
    if has_drafts or not requests or len(requests) > max_size:
        return False
    for req, n in zip(requests, num_tokens):
        if n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return False
        if req.pending_children or req.owes_prompt_logprobs:
            return False
    return True


class _Staging:
    """One set of host buffers for a decode step's inputs, with numpy views made once (filling them
    reads no tensor)."""

    def __init__(self, rows: int, max_blocks: int, pad_block: int, pin: bool) -> None:
        self.ids = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        self.pos = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        self.slots = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        self.lens = torch.ones(rows, dtype=torch.int32, pin_memory=pin)
        self.tables = torch.full((rows, max_blocks), pad_block, dtype=torch.int32, pin_memory=pin)
        self.ids_np, self.pos_np, self.slots_np = self.ids.numpy(), self.pos.numpy(), self.slots.numpy()
        self.lens_np, self.tables_np = self.lens.numpy(), self.tables.numpy()


class DecodeGraphs:
    """Static input buffers, one graph (or, in padded mode, one eager run) per captured size."""

    def __init__(
        self,
        model: object,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        block_size: int,
        max_model_len: int,
        pad_block: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pad_block = pad_block
        self.device = device
        self.capture_graphs = capture
        max_bs = sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # Host staging, two sets used in turn (pinned on CUDA: the copies to the device do not wait
        # on the host). With overlap scheduling a step is filled while the one before may still
        # have its copies queued; the set before that was read by a step whose tokens the host has
        # since waited for, so it is free to rewrite.
        self.staging = [_Staging(max_bs, self.max_blocks, pad_block, device.type == "cuda") for _ in range(2)]
        self._turn = 0
        first = self.staging[0]
        # The device buffers every graph reads (rows past a step's size hold padding).
        self.ids = first.ids.to(device, copy=True)
        self.pos = first.pos.to(device, copy=True)
        self.slots = torch.full((max_bs,), pad_block * block_size, dtype=torch.long, device=device)
        self.lens = first.lens.to(device, copy=True)
        self.tables = first.tables.to(device, copy=True)
        self.qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits into the first rows of this one buffer: the logits each
        # graph computes are temporaries its successors' captures reuse in the shared pool.
        self.logits: torch.Tensor | None = None
        # Decode steps run through the static buffers so far (the start-up log and tests read it).
        self.steps = 0

    def batch(self, size: int) -> ForwardBatch:
        """A ForwardBatch over the first `size` rows of the static buffers, its attention layout set."""
        backend = self.model.backend  # type: ignore[attr-defined]
        batch = ForwardBatch(
            input_ids=self.ids[:size],
            positions=self.pos[:size],
            slot_mapping=self.slots[:size],
            logits_indices=torch.arange(size, device=self.device),
            query_start_loc=np.arange(size + 1, dtype=np.int64),
            query_lens=np.ones(size, dtype=np.int64),
            seq_lens=np.ones(size, dtype=np.int64),
            block_tables=np.zeros((size, 1), dtype=np.int64),
            block_size=self.block_size,
        )
        batch.attn_metadata = backend.static_layout(
            self.tables[:size], self.lens[:size], self.qsl[: size + 1], 1, self.max_model_len
        )
        return batch

    def _forward(self, size: int) -> torch.Tensor:
        model = self.model
        hidden = model(self.batch(size), self.kv_caches)  # type: ignore[operator]
        return model.compute_logits(hidden)  # type: ignore[attr-defined]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, the largest first (the others then fit in its memory pool)."""
        if not self.capture_graphs:
            return
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                # Once eagerly first: Triton compiles its kernels, cuBLAS picks its algorithms.
                warm = self._forward(size)
                if self.logits is None:
                    self.logits = torch.empty_like(warm)
                del warm
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[:size].copy_(self._forward(size))
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def fill(self, requests: Sequence[Request], feed: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Write the decode inputs of `requests` into the first rows, padding up to the captured
        size, which it returns. `feed`: (rows, tokens) on the device, input tokens the host does not
        know yet (overlap scheduling's placeholders), written over those rows after the copy."""
        n = len(requests)
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"a decode batch of {n} is past the largest captured size {self.sizes[-1]}")
        bs, pad = self.block_size, self.pad_block
        host = self.staging[self._turn]
        self._turn ^= 1
        ids, pos, slots, lens, tables = host.ids_np, host.pos_np, host.slots_np, host.lens_np, host.tables_np
        width = 1
        for i, req in enumerate(requests):
            p = req.num_computed_tokens
            blocks = req.block_ids
            ids[i] = req.token_ids[p]
            pos[i] = p
            slots[i] = blocks[p // bs] * bs + p % bs
            lens[i] = p + 1
            used = p // bs + 1
            tables[i, :used] = blocks[:used]
            width = max(width, used)
        # Padding rows: a one-token context in the pad block. The kernel reads a row's table only
        # up to its length, so their first column is all that must be right (and a real row's
        # columns past its length may hold anything).
        ids[n:size] = 0
        pos[n:size] = 0
        slots[n:size] = pad * bs
        lens[n:size] = 1
        tables[n:size, 0] = pad
        self.ids[:size].copy_(host.ids[:size], non_blocking=True)
        self.pos[:size].copy_(host.pos[:size], non_blocking=True)
        self.slots[:size].copy_(host.slots[:size], non_blocking=True)
        self.lens[:size].copy_(host.lens[:size], non_blocking=True)
        self.tables[:size, :width].copy_(host.tables[:size, :width], non_blocking=True)
        if feed is not None:
            self.ids.index_copy_(0, *feed)
        return size

    def run(
        self, requests: Sequence[Request], feed: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The logits [n, V] of a decode step over `requests` (graph_step said yes); `feed` as `fill`."""
        size = self.fill(requests, feed)
        self.steps += 1
        if self.capture_graphs:
            self.graphs[size].replay()
            assert self.logits is not None  # set by capture()
            logits = self.logits
        else:
            logits = self._forward(size)
        return logits[: len(requests)]
