"""Draft trees from heads over the target's own features: EAGLE (EAGLE-2's dynamic tree) and Medusa.

The runner hands the drafter the target's last hidden states after every forward (`capture`): they
go into a paged **feature store** beside the KV cache, indexed like it (one row of `hidden_size`
per KV slot, `block_caches` so copy-on-write and swapping move it with the KV), in one write per
step: every row at its own slot, so a step costs the same few tensor operations whatever the
requests' lengths and whether or not the head drafted (a verified tree's accepted path, when it
is not the first branch, is then moved down like its KV). Medusa, which reads only the last
feature, skips the write while the controller holds a zero verdict (`keeps_features`). Feature p
is what the target's LM head read to choose token p + 1; a cached prefix's blocks hold the
features of the request that computed them, as they hold its KV.

**EAGLE.** The head's decoder layer keeps its own paged KV cache, indexed by the target's block
tables (same block ids, its own tensors; copy-on-write copies it too), and catches up lazily: a
proposal's first pass feeds every position from where the head's KV ends up to the last known
feature, row p being (feature p, token p + 1), read from the store in one gather; its last row
predicts the feature after the last known token, whose logits (through the target's LM head) give
the root's children. While the controller keeps the head off nothing of it runs; the positions it
missed are fed by the next proposal's first pass (`DraftPass.catch_up_tokens`, which the
controller prices and the planner caps per step). Then, per depth, the `tree_topk` best nodes of
that depth (by path log-probability) are expanded: one head pass over every node expanded so far
(the tree's nodes are this pass's queries, each seeing the context and its expanded ancestors:
`ForwardBatch.tree_bits`), laid out in the head's KV slots after the last known token (slots the
scheduler reserved for the target's verification of the same nodes; the head's own tensors, so
nothing of the target's is touched, and later catch-up overwrites them). Row of node x at depth d:
(its parent's predicted feature, x), at position root + d - 1 (a pass's per-row values go to the
device as one tensor, `_tree_batch`; the proposal's predictions are rows of one table). A tree of
k nodes is at most k deep, so a request given k nodes is expanded to depth min(`tree_depth`, k): a
smaller node budget costs fewer head passes. The proposal is the k best nodes by path
log-probability (a node's is at most its parent's, so they form a tree), ordered depth first, best
child first: the most likely path is the first branch, whose KV needs no copy when it is accepted.

**Medusa.** Head k over the last known feature proposes the token k after the last known one; the
tree is the best `num_speculative_tokens` paths of the per-head top-k's cartesian product by the
product of their probabilities (best first). One pass, whatever the tree's size.

Both turn features into tokens through the **read-out** (`DraftReadout`, tandem/model/draft_vocab.py):
the rows of the target's LM head for the draft vocabulary (`draft_vocab_size` tokens the target
emits most often, from the head folder's draft_vocab.json), in the head's own kernel form, their
top-k mapped back to token ids; the whole LM head where the folder has no such file or the size
covers the vocabulary. Drafts stay deterministic proposals, so verification is unchanged.

A request whose last known feature was not computed here (KV computed by another instance) gets
a chain repeating its last token: rejected, harmless.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.core.draft_tree import DraftTree
from tandem.core.request import Request
from tandem.core.step_io import DraftPass, RunnerOutput, SchedulerOutput
from tandem.model.attention import get_attention_backend
from tandem.model.draft_heads import EagleHead, HeadConfig, MedusaHeads, eagle_layer_config, load_head
from tandem.model.draft_vocab import DraftReadout, draft_token_ids
from tandem.model.forward_batch import ForwardBatch
from tandem.model.kv_quant import KVCacheFormat
from tandem.model.layers import RotaryEmbedding
from tandem.model.loader import model_module
from tandem.spec.config import SpeculativeConfig
from tandem.worker.batch import build_batch
from tandem.worker.device import DevicePlan


class HeadHost(Protocol):
    """What the head drafter uses of the runner: its KV layout and placement, and the target."""

    block_size: int
    device: torch.device
    dtype: torch.dtype
    plan: DevicePlan

    def allocate_kv(self, mc: ModelConfig, num_blocks: int) -> list[torch.Tensor]: ...


@dataclass(slots=True)
class HeadWork:
    """What the drafter has done, counted (tests and benchmarks read it: a step in which no request
    drafts must cost one feature write and nothing else)."""

    # Target forwards whose features were stored: one store write each (`capture`).
    feature_writes: int = 0
    # Feature rows written: the forwards' rows plus accepted paths moved into place.
    feature_rows: int = 0
    # Head forward passes (EAGLE: a catch-up pass and one per expanded depth; Medusa: one).
    passes: int = 0
    # Positions fed to the head's KV beyond what proposing on consecutive steps feeds.
    catch_up_tokens: int = 0


class _Node:
    __slots__ = ("children", "depth", "feature", "parent", "score", "token")

    def __init__(self, token: int, parent: int, depth: int, score: float) -> None:
        self.token = token
        self.parent = parent
        self.depth = depth
        self.score = score
        self.feature = -1  # EAGLE: the row of the head's prediction after this node (`_eagle`)
        self.children: list[int] = []


def _tree(nodes: list[_Node], chosen: list[int]) -> DraftTree:
    """The chosen nodes (closed under parents) depth first, best child first."""
    keep = set(chosen)
    kids: dict[int, list[int]] = {}
    for i in chosen:
        kids.setdefault(nodes[i].parent, []).append(i)
    order: list[int] = []
    stack = sorted(kids.get(-1, []), key=lambda i: nodes[i].score)
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(sorted((c for c in kids.get(i, []) if c in keep), key=lambda c: nodes[c].score))
    index = {node: j for j, node in enumerate(order)}
    return DraftTree(
        tuple(nodes[i].token for i in order),
        tuple(-1 if nodes[i].parent < 0 else index[nodes[i].parent] for i in order),
    )


def _walk(tree: DraftTree, tokens: list[int]) -> list[int]:
    """The nodes of an accepted path from its tokens: at each node the first child holding the
    next one, as verification takes it (a repeated child is never the one accepted)."""
    path: list[int] = []
    for tok in tokens:
        path.append(next(c for c in tree.children(path[-1] if path else -1) if tree.tokens[c] == tok))
    return path


def _slot(req: Request, position: int, block_size: int) -> int:
    return req.block_ids[position // block_size] * block_size + position % block_size


def _pad(nodes: list[_Node], k: int) -> None:
    """A vocabulary smaller than the tree: repeat the best first token (a repeated child is never
    accepted twice: verification takes the first match, or has taken its mass out of p)."""
    while len(nodes) < k:
        nodes.append(_Node(nodes[0].token, -1, 1, -1e9 - len(nodes)))


def _best(nodes: list[_Node], k: int) -> list[int]:
    """The k best nodes by path log-probability (ties: shallower, then older), closed under parents."""
    return sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:k]


class HeadDrafter:
    def __init__(
        self,
        host: HeadHost,
        target: object,
        target_config: ModelConfig,
        spec: SpeculativeConfig,
        engine_config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        if not spec.model:
            raise ValueError(f"speculative_config method {spec.method!r} needs the head's folder (model)")
        cfg = HeadConfig.from_folder(spec.model)
        if cfg.method != spec.method:
            raise ValueError(
                f"speculative_config.model {spec.model!r} is a {cfg.method} head, not a {spec.method} one"
            )
        self.host = host
        self.method = cfg.method
        self.target = target
        self.target_module = model_module(target)  # type: ignore[arg-type]
        self.topk = spec.tree_topk
        self.depth = spec.tree_depth
        self.head: EagleHead | MedusaHeads
        self.kv_caches: list[torch.Tensor] = []
        if cfg.method == "eagle":
            layer_cfg = eagle_layer_config(target_config, cfg.intermediate_size)
            backend = get_attention_backend(
                host.plan.attention_backend,
                layer_cfg.num_heads,
                layer_cfg.num_kv_heads,
                layer_cfg.head_dim,
                layer_cfg.sliding_window,
                KVCacheFormat(engine_config.kv_cache_dtype, host.dtype),
            )
            # Tree rows sit up to tree_depth positions past the last known token.
            rotary = RotaryEmbedding(
                layer_cfg.head_dim, max_model_len + spec.tree_depth + 1, layer_cfg.rope, host.device
            )
            self.head = load_head(
                cfg, target_config, host.dtype, host.device, backend, rotary, host.plan.cpu_kernels
            )
            self.kv_caches = host.allocate_kv(layer_cfg, num_blocks)
        else:
            self.head = load_head(
                cfg, target_config, host.dtype, host.device, None, None, host.plan.cpu_kernels
            )
            self.depth = min(self.depth, cfg.num_heads)
        # The read-out: the draft vocabulary's rows of the target's LM head (the whole head where
        # the folder has no draft_vocab.json or `draft_vocab_size` asks for all of it).
        ids = draft_token_ids(
            cfg.path, target_config.vocab_size, spec.draft_vocab_size, target_config.eos_token_ids
        )
        self.readout = DraftReadout(target, ids)
        # The feature store: one row per KV slot, `[1, num_blocks, block_size, hidden]` (a cache
        # `block_caches` lists: copy-on-write and swapping treat it as one more layer).
        self.feature_cache = torch.zeros(
            (1, num_blocks, host.block_size, target_config.hidden_size), dtype=host.dtype, device=host.device
        )
        self._flat = self.feature_cache.view(-1, target_config.hidden_size)
        # request id -> the first position whose feature was computed here (earlier ones: a cached
        # prefix's, trusted like its KV, or another instance's, never written here).
        self.seen_from: dict[str, int] = {}
        # EAGLE: request id -> how many leading positions hold the head's KV
        self.valid: dict[str, int] = {}
        # request id -> its token count after the last step it drafted in (what a proposal on the
        # next step feeds is that step's; anything past it, a catch-up).
        self.drafted_to: dict[str, int] = {}
        # Medusa: requests whose last step's features were not stored (`keeps_features`): their
        # next proposal has no feature to read, and falls back to a harmless chain.
        self._unwritten: set[str] = set()
        self.work = HeadWork()
        # The last proposal's passes, timed (the runner reports them with the step's output).
        self.passes: list[DraftPass] = []
        self._no_rows = torch.empty(0, dtype=torch.long, device=host.device)  # a pass's logits_indices

    # -- bookkeeping ----------------------------------------------------------------------------

    def block_caches(self) -> list[list[torch.Tensor]]:
        """The caches indexed by the target's block ids: the head's KV (EAGLE) and the features."""
        return ([self.kv_caches] if self.kv_caches else []) + [[self.feature_cache]]

    def sync(self, reqs: list[Request], preempted: list[Request], finished: list[str]) -> None:
        """Before a step: forget ended and preempted requests, and clip the head KV that rejected
        drafts or a rewind made stale (past the target's computed tokens). A request seen for the
        first time trusts the head KV and features of the positions it did not compute here (a
        cached prefix's blocks hold what the request that computed them fed and stored)."""
        for rid in finished:
            self._drop(rid)
        for r in preempted:
            self._drop(r.request_id)
        valid, seen = self.valid, self.seen_from
        for r in reqs:
            rid, done = r.request_id, r.num_computed_tokens
            v = valid.get(rid)
            if v is None:
                valid[rid] = seen[rid] = done
            elif v > done:
                valid[rid] = done

    def _drop(self, rid: str) -> None:
        self.valid.pop(rid, None)
        self.seen_from.pop(rid, None)
        self.drafted_to.pop(rid, None)
        self._unwritten.discard(rid)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._drop(rid)

    def keeps_features(self, sched: SchedulerOutput) -> bool:
        """Whether a step's features must be stored. EAGLE: always (its catch-up feeds every
        position since its KV ends, so a skipped step would feed it stale rows). Medusa reads only
        the last known feature: a step that drafts nothing need not store them where the plan says
        the next step drafts nothing either (`Plan.drafts_next`: a zero verdict held)."""
        if self.method == "eagle" or sched.num_draft:
            return True
        return bool(getattr(sched.spec_plan, "drafts_next", True))

    def capture(
        self,
        reqs: list[Request],
        slots: torch.Tensor,
        hidden: torch.Tensor,
        trees: dict[str, DraftTree],
        out: RunnerOutput,
        keep: bool = True,
    ) -> None:
        """After the target's forward and verification: store every row's feature at its own slot
        (`slots`: the batch's slot mapping), then move each accepted tree path that is not the
        first branch down to the slots after its root, as its KV was (a forked sample's features
        are its leader's: they share blocks). `keep` False (`keeps_features`): store nothing."""
        w = self.work
        if keep:
            self._flat.index_copy_(0, slots, hidden.to(self._flat.dtype))
            w.feature_writes += 1
            w.feature_rows += int(hidden.shape[0])
            if self._unwritten:  # only Medusa skips writes: EAGLE never pays the pass over reqs
                self._unwritten.difference_update(r.request_id for r in reqs)
        else:
            self._unwritten.update(r.request_id for r in reqs)
        for req in reqs:
            for child in req.pending_children:
                # Everything the leader's head has not fed yet (its prompt, unless it drafted) is
                # the child's to feed as well.
                cid = child.request_id
                self.valid[cid] = self.valid.get(req.request_id, req.num_computed_tokens)
                self.seen_from[cid] = self.seen_from.get(req.request_id, req.num_computed_tokens)
        if not out.accepted and not trees:
            return
        src: list[int] = []
        dst: list[int] = []
        bs = self.host.block_size
        for req in reqs:
            rid = req.request_id
            accepted = out.accepted.get(rid)
            if accepted is None:
                continue
            # The drafting step's tokens: the root, the accepted drafts and the target's own.
            self.drafted_to[rid] = req.num_tokens + len(accepted) + 1
            tree = trees.get(rid)
            if tree is None or not accepted:
                continue
            root = req.num_computed_tokens  # not advanced yet
            for j, node in enumerate(_walk(tree, accepted)):
                if node != j:
                    src.append(_slot(req, root + node + 1, bs))
                    dst.append(_slot(req, root + j + 1, bs))
        if src:
            dev = self._flat.device
            self._flat[torch.tensor(dst, device=dev)] = self._flat[torch.tensor(src, device=dev)]
            w.feature_rows += len(src)

    # -- proposals ------------------------------------------------------------------------------

    def propose(self, todo: list[tuple[Request, int]]) -> dict[str, DraftTree]:
        """A tree of exactly k nodes per request. The head's passes, timed, are left in
        `self.passes` for the runner to report (`RunnerOutput.draft_passes`)."""
        self.passes = []
        ready: list[tuple[Request, int]] = []
        out: dict[str, DraftTree] = {}
        for r, k in todo:
            last = r.num_tokens - 2  # the last position whose feature the target has computed
            if last < self.seen_from.get(r.request_id, last + 1) or r.request_id in self._unwritten:
                out[r.request_id] = DraftTree.chain([r.token_ids[-1]] * k)
            else:
                ready.append((r, k))
        if ready:
            out.update(self._eagle(ready) if self.method == "eagle" else self._medusa(ready))
        return out

    def _catch_up(self, r: Request, start: int) -> tuple[int, int]:
        """Positions from `start` to the last known one that a proposal on every step would not
        feed now (its previous step's tokens are what it feeds), and of those, how many follow the
        prompt (missed while the head was off; the rest are a new request's prompt)."""
        last = r.num_tokens - 2
        drafted = self.drafted_to.get(r.request_id)
        first = start if drafted is None else max(start, drafted - 1)
        behind = max(0, last + 1 - first)
        missed = max(0, last + 1 - max(first, r.num_prompt_tokens))
        return behind, min(missed, behind)

    def _logprobs(self, feats: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the read-out's tokens (columns: `self.readout.tokens`)."""
        return self.readout.logprobs(feats)

    def _top(self, logp: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """Each row's `tree_topk` best read-out tokens and their log-probabilities, best first: one
        top-k and one copy to the host for every row of a pass."""
        values, index = logp.topk(min(self.topk, logp.shape[-1]), dim=-1)
        return values.tolist(), self.readout.tokens(index).tolist()

    @staticmethod
    def _children(nodes: list[_Node], parent: int, values: list[float], tokens: list[int]) -> list[int]:
        base = nodes[parent].score if parent >= 0 else 0.0
        depth = nodes[parent].depth + 1 if parent >= 0 else 1
        made = []
        for v, t in zip(values, tokens):
            nodes.append(_Node(t, parent, depth, base + v))
            made.append(len(nodes) - 1)
        if parent >= 0:
            nodes[parent].children = made
        return made

    def _eagle(self, todo: list[tuple[Request, int]]) -> dict[str, DraftTree]:
        host, head = self.host, self.head
        assert isinstance(head, EagleHead)
        embed: Any = self.target_module.embed_tokens
        reqs = [r for r, _ in todo]
        # A tree of k nodes is at most k deep: expansions past that depth could place no node.
        depths = [min(self.depth, k) for _, k in todo]
        start_t = time.perf_counter()
        # Pass 0: catch up to the last known feature; its row predicts the root's children.
        starts, q_lens, tokens = [], [], []
        behind = missed = 0
        for r in reqs:
            last = r.num_tokens - 2
            s = min(self.valid[r.request_id], last)
            b, m = self._catch_up(r, s)
            behind, missed = behind + b, missed + m
            starts.append(s)
            q_lens.append(last + 1 - s)
            tokens.extend(r.token_ids[s + 1 : last + 2])
        batch, ends = build_batch(reqs, q_lens, host.block_size, host.device, starts_l=starts)
        batch.input_ids = torch.tensor(tokens, dtype=torch.long, device=host.device)
        head.backend.prepare(batch)
        feats = self._flat[batch.slot_mapping]  # the target's features of every fed position
        g = head(embed(batch.input_ids), feats, batch, self.kv_caches[0])
        root_g = g[torch.from_numpy(ends - 1).to(g.device)]
        root_logp = self._logprobs(root_g)
        # Every prediction of this proposal, one row each: the roots' (row i: request i's), then
        # each tree pass's new nodes' (`_Node.feature`); a tree row reads its parent's.
        table = root_g
        tables = batch.block_tables
        for r in reqs:
            self.valid[r.request_id] = r.num_tokens - 1
        trees: list[list[_Node]] = []
        expanded: list[list[int]] = []
        frontier: list[list[int]] = []
        caps: list[int] = []
        root_v, root_t = self._top(root_logp)
        for i, r in enumerate(reqs):
            nodes: list[_Node] = []
            frontier.append(self._children(nodes, -1, root_v[i], root_t[i]))
            trees.append(nodes)
            expanded.append([])
            # The head's scratch rows: the slots after the last known token that the request's
            # blocks hold (the scheduler reserved at least k).
            # (At most 63: a tree mask is one 64-bit word per query token.)
            room = len(r.block_ids) * host.block_size - (r.num_tokens - 1)
            caps.append(min(room, self.topk * depths[i], 63))
        w = self.work
        w.passes += 1
        w.catch_up_tokens += behind
        self.passes.append(
            DraftPass(len(reqs), time.perf_counter() - start_t, catch_up_tokens=behind, missed_tokens=missed)
        )
        for level in range(1, max(depths)):
            start_t = time.perf_counter()
            picks: list[list[int]] = []
            for i, nodes in enumerate(trees):
                room = caps[i] - len(expanded[i]) if level < depths[i] else 0
                best = sorted(frontier[i], key=lambda j: -nodes[j].score)[: min(self.topk, max(0, room))]
                picks.append(best)
                expanded[i].extend(best)
            active = [i for i, p in enumerate(picks) if p]
            if not active:
                break
            batch, parent_rows, new_rows = self._tree_batch(reqs, active, trees, expanded, picks, tables)
            head.backend.prepare(batch)
            g = head(embed(batch.input_ids), table[parent_rows], batch, self.kv_caches[0])
            new_g = g[new_rows]
            # The new nodes' predictions: the table's next rows, in the order of `picks`.
            row = table.shape[0]
            table = torch.cat((table, new_g))
            top_v, top_t = self._top(self._logprobs(new_g))
            j = 0
            for i in active:
                nxt: list[int] = []
                for node in picks[i]:
                    trees[i][node].feature = row + j
                    nxt.extend(self._children(trees[i], node, top_v[j], top_t[j]))
                    j += 1
                frontier[i] = nxt
            w.passes += 1
            self.passes.append(DraftPass(len(active), time.perf_counter() - start_t))
        out = {}
        for i, (r, k) in enumerate(todo):
            nodes = trees[i]
            if len(nodes) < k:  # too few candidates for k nodes: more of the root's children
                first = len([n for n in nodes if n.parent < 0])
                more_v, more_i = root_logp[i].topk(min(first + k - len(nodes), root_logp.shape[1]))
                more_t = self.readout.tokens(more_i)
                for v, t in zip(more_v.tolist()[first:], more_t.tolist()[first:]):
                    nodes.append(_Node(t, -1, 1, v))
            _pad(nodes, k)
            out[r.request_id] = _tree(trees[i], _best(trees[i], k))
        return out

    def _tree_batch(
        self,
        reqs: list[Request],
        active: list[int],
        trees: list[list[_Node]],
        expanded: list[list[int]],
        picks: list[list[int]],
        tables: np.ndarray,
    ) -> tuple[ForwardBatch, torch.Tensor, slice | torch.Tensor]:
        """A tree pass over the `active` requests: request i's expanded nodes, in order, at the slots
        after its last known token (`tables`: the requests' block tables), each at its depth's
        position, seeing the context and its expanded ancestors (`tree_bits`). Also the rows of
        their parents' predictions in the proposal's feature table and the rows of the new nodes
        (`picks[i]`, the last of each request's) in the pass. Every per-row value goes to the
        device in one tensor."""
        bs = self.host.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bits: list[int] = []
        parents: list[int] = []
        new_rows: list[int] = []
        q_lens: list[int] = []
        starts: list[int] = []
        for i in active:
            r, nodes, order = reqs[i], trees[i], expanded[i]
            first = r.num_tokens - 1  # the slot after the last known token (the root's)
            where = {node: j for j, node in enumerate(order)}
            word: list[int] = []
            for j, node in enumerate(order):
                n = nodes[node]
                ids.append(n.token)
                positions.append(first - 1 + n.depth)
                slots.append(_slot(r, first + j, bs))
                word.append((0 if n.parent < 0 else word[where[n.parent]]) | (1 << j))
                parents.append(i if n.parent < 0 else nodes[n.parent].feature)
            bits.extend(word)
            new_rows.extend(range(len(ids) - len(picks[i]), len(ids)))
            q_lens.append(len(order))
            starts.append(first)
        rows = torch.tensor([ids, positions, slots, bits, parents], dtype=torch.long, device=self.host.device)
        q = np.asarray(q_lens, dtype=np.int64)
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        batch = ForwardBatch(
            input_ids=rows[0],
            positions=rows[1],
            slot_mapping=rows[2],
            logits_indices=self._no_rows,
            query_start_loc=qsl,
            query_lens=q,
            seq_lens=np.asarray(starts, dtype=np.int64) + q,
            block_tables=tables[active],
            block_size=bs,
            tree_bits=rows[3],
        )
        one = len(active) == 1  # the new rows are the pass's last: a slice, no index tensor
        new = slice(new_rows[0], len(ids)) if one else torch.tensor(new_rows, device=self.host.device)
        return batch, rows[4], new

    def _medusa(self, todo: list[tuple[Request, int]]) -> dict[str, DraftTree]:
        head = self.head
        assert isinstance(head, MedusaHeads)
        start_t = time.perf_counter()
        bs = self.host.block_size
        where = [_slot(r, r.num_tokens - 2, bs) for r, _ in todo]  # each request's last known feature
        last = self._flat[torch.tensor(where, device=self._flat.device)]
        logp = self._logprobs(head(last).flatten(0, 1)).view(len(head.heads), len(todo), -1)
        # One pass reads only the last feature: nothing to catch up on, whatever was missed.
        self.work.passes += 1
        self.passes.append(DraftPass(len(todo), time.perf_counter() - start_t))
        out = {}
        for i, (r, k) in enumerate(todo):
            width = min(self.topk, logp.shape[-1])
            while width < logp.shape[-1] and sum(width**d for d in range(1, self.depth + 1)) < k:
                width += 1
            values, index = logp[: self.depth, i].topk(width, dim=-1)
            tokens = self.readout.tokens(index)
            vals, toks = values.tolist(), tokens.tolist()
            nodes: list[_Node] = []
            # Best first over the product: popping a node offers its next sibling and first child.
            heap: list[tuple[float, int, int, int, int]] = [(-vals[0][0], 0, 1, -1, 0)]
            seq = 1
            while heap and len(nodes) < k:
                neg, _, depth, parent, rank = heapq.heappop(heap)
                nodes.append(_Node(toks[depth - 1][rank], parent, depth, -neg))
                me = len(nodes) - 1
                base = nodes[parent].score if parent >= 0 else 0.0
                if rank + 1 < width:
                    heapq.heappush(heap, (-(base + vals[depth - 1][rank + 1]), seq, depth, parent, rank + 1))
                    seq += 1
                if depth < self.depth:
                    heapq.heappush(heap, (-(-neg + vals[depth][0]), seq, depth + 1, me, 0))
                    seq += 1
            _pad(nodes, k)
            out[r.request_id] = _tree(nodes, list(range(len(nodes))))
        return out
