"""Tree verification in the runner: the layout of a request's draft tree in the flat batch, the
walk down the tree over the target's rows, and the accepted path's KV moved into place.

A tree request's query tokens are its last verified token (the root) and the tree's nodes in
order; node j is query token j + 1, at position `root + depth` (not `root + j + 1`), seeing its
ancestors and itself (`ForwardBatch.tree_bits`; every other token gets all bits, so the mask is
causal there). Its KV is written at the query tokens' slots, one after another. After the walk,
the accepted nodes' rows are copied down to the slots right after the root unless they are there
already (a path that is a prefix of the node order, always so for a chain): the cache then holds
the accepted tokens exactly where a plain decode would have put them, and the rest is rewound.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.core.draft_tree import DraftTree, verify_greedy
from tandem.core.request import Request
from tandem.core.step_io import RunnerOutput
from tandem.model.forward_batch import ForwardBatch
from tandem.spec.rejection import verify_tree_sampled
from tandem.worker.sampler import Sampler, SamplingBatch

# A token outside every tree sees every query token before it (the plain causal mask).
ALL_BITS = -1


def lay_out_trees(batch: ForwardBatch, reqs: list[Request], ends: np.ndarray, trees: dict[str, DraftTree]) -> None:
    """Positions by depth and the ancestor masks of the requests verifying a tree."""
    positions = batch.positions.cpu().numpy().copy()
    bits = np.full(positions.shape[0], ALL_BITS, dtype=np.int64)
    for i, req in enumerate(reqs):
        tree = trees.get(req.request_id)
        if tree is None:
            continue
        end = int(ends[i])
        root = end - 1 - len(tree)  # the root's row in the flat batch
        positions[root + 1 : end] = positions[root] + np.asarray(tree.depths(), dtype=np.int64)
        bits[root:end] = tree.ancestor_bits()
    device = batch.positions.device
    batch.positions = torch.from_numpy(positions).to(device)
    batch.tree_bits = torch.from_numpy(bits).to(device)


def path_history(tree: DraftTree, query: int) -> list[int]:
    """The draft tokens before query token `query` of the tree (its node's ancestors' tokens)."""
    return [tree.tokens[n] for n in tree.path(query - 1)] if query else []


def verify_trees(
    sampler: Sampler,
    logits: torch.Tensor,
    sb: SamplingBatch,
    spans: list[tuple[Request, int, DraftTree]],
    out: RunnerOutput,
    used_rows: dict[str, list[int]],
) -> dict[str, list[int]]:
    """Walk each request's tree over its rows (greedy or recursive rejection sampling); fills
    `out` (accepted tokens, the token after them, logprobs) and `used_rows` (the rows each emitted
    token came from). Returns each request's accepted nodes."""
    logits = logits.float()
    target = sampler.greedy_tokens(logits, sb).tolist() if any(m.sampling.greedy for m, _, _ in spans) else []
    probs = sampler.distribution(logits, sb) if not all(m.sampling.greedy for m, _, _ in spans) else None
    raw = torch.log_softmax(logits, dim=-1) if any(m.sampling.logprobs is not None for m, _, _ in spans) else None
    paths: dict[str, list[int]] = {}
    for member, first, tree in spans:
        rows = slice(first, first + len(tree) + 1)
        if member.sampling.greedy:
            accepted, extra = verify_greedy(tree, target[rows])
        else:
            assert probs is not None
            accepted, extra = verify_tree_sampled(tree, probs[rows], sb.generators[first])
        rid = member.request_id
        tokens = [tree.tokens[n] for n in accepted]
        if tokens:
            out.accepted[rid] = tokens
        out.sampled[rid] = extra
        paths[rid] = accepted
        used = used_rows[rid] = [first] + [first + n + 1 for n in accepted]
        if raw is not None and member.sampling.logprobs is not None:
            emitted = [*tokens, extra]
            lps = sampler.logprobs(
                raw[used], torch.tensor(emitted, device=raw.device), [member.sampling.logprobs] * len(emitted)
            )
            out.logprobs[rid] = [lp for lp in lps if lp is not None]
    return paths


def compact_accepted(
    kv_caches: list[torch.Tensor],
    reqs: list[Request],
    paths: dict[str, list[int]],
    out: RunnerOutput,
    block_size: int,
) -> None:
    """Copy each accepted path's KV rows (as far as `out` still keeps it) to the slots right after
    its root. kv_caches: [2, num_blocks, block_size, ...] per layer."""
    src: list[int] = []
    dst: list[int] = []
    for req in reqs:
        path = paths.get(req.request_id)
        if not path:
            continue
        kept = path[: len(out.accepted.get(req.request_id, ()))]
        root = req.num_computed_tokens  # the root's position (the scheduler has not advanced it yet)
        for j, node in enumerate(kept):
            if node != j:
                src.append(_slot(req, root + node + 1, block_size))
                dst.append(_slot(req, root + j + 1, block_size))
    if not src:
        return
    device = kv_caches[0].device
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    for cache in kv_caches:
        flat = cache.view(2, -1, *cache.shape[3:])
        flat[:, dst_t] = flat[:, src_t].clone()  # gathered first: a source may be another's target


def _slot(req: Request, position: int, block_size: int) -> int:
    return req.block_ids[position // block_size] * block_size + position % block_size
