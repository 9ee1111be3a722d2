"""Speculative decoding in the scheduler, with a fake runner (no torch, no model).

A fake `SpecHook` asks for a random number of draft tokens per decoding request, either proposing them
itself (as n-gram lookup does, possibly fewer than asked) or leaving them to the runner (as a draft model
does). The fake runner writes every scheduled token, drafts included, into a simulated paged KV store
that records, per slot, the position, the token and a hash of the whole sequence the token was computed
under; it then verifies the drafts: against a deterministic target (accept the drafts that match the
target's own tokens: the outputs must equal those of the run without speculation), or by accepting a
random prefix and sampling a random token (only the invariants are checked).

Checked after every step: the token budget with drafts counted; blocks covering the computed plus
scheduled tokens; drafts only on decoding requests and only as many as planned; `update` rewinding
`num_computed_tokens` over rejected drafts and keeping accepted ones (`num_tokens - 1` after a verify);
no block freed or swapped by a rewind (block tables only grow while a request runs, except copy-on-write
and switching to a cached copy of the same KV); block refcounts equal to the live holders plus the
prefix cache; every cached block holding exactly the verified tokens of its tree path, computed under
that path (never a draft), checked too whenever `cache_computed` is called; speculation never holding
more blocks than the request could ever need; drafts never making a request wait for blocks or preempt
another (they are dropped instead), besides scheduler_harness.CheckedScheduler's victim rules. At the end
every block is released.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduler_harness import (
    VOCAB,
    CheckedScheduler,
    make_group,
    next_token,
    path_blocks,
    path_tokens,
    tree_nodes,
)

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.policy import SchedulingConfig
from tandem.core.prefix_cache import Node
from tandem.core.request import Request, RequestStatus
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.spec.config import SpeculativeConfig
from tandem.spec.controller import Plan
from tandem.spec.planner import SpecPlanner


def ctx(seq: list[int], pos: int) -> int:
    """What the KV at `pos` depends on: the whole sequence up to and including it."""
    return hash(tuple(seq[: pos + 1]))


def continuation(target, seq: list[int], index: int, k: int) -> list[int]:
    """The target's own next k tokens after `seq`."""
    seq = list(seq)
    out = []
    for _ in range(k):
        out.append(target(seq, index))
        seq.append(out[-1])
    return out


def guess(target, req: Request, k: int, rng: random.Random) -> list[int]:
    """k draft tokens: the target's continuation up to a random point, random tokens from there."""
    good = continuation(target, req.token_ids, req.sample_index, k)
    wrong_from = rng.randint(0, k)
    out = good[:wrong_from]
    if wrong_from < k:
        out.append((good[wrong_from] + rng.randint(1, VOCAB - 1)) % VOCAB)  # surely rejected
        out += [rng.randrange(VOCAB) for _ in range(k - wrong_from - 1)]
    return out


def reference(target, req: Request, max_model_len: int) -> list[int]:
    """One sample's output computed without a scheduler (as scheduler_harness.reference_output, any target)."""
    sp = req.sampling
    toks = list(req.prompt_token_ids)
    out: list[int] = []
    while True:
        t = target(toks, req.sample_index)
        toks.append(t)
        out.append(t)
        if len(out) > sp.min_tokens and (
            (not sp.ignore_eos and t in req.eos_token_ids) or t in sp.stop_token_ids
        ):
            return out
        if len(out) >= req.max_tokens or len(toks) >= max_model_len:
            return out


def room(req: Request, max_model_len: int) -> int:
    return min(req.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens)


class RandomDrafts:
    """A SpecHook: a random draft length per decoding request; proposes the drafts itself in mode
    "scheduler" (possibly fewer than asked, even none), leaves them to the runner in mode "runner"."""

    def __init__(self, mode: str, max_k: int, rng: random.Random, target) -> None:
        self.mode = mode
        self.max_k = max_k
        self.rng = rng
        self.target = target

    def plan(self, decoding: list[Request], other_tokens: int, max_model_len: int) -> Plan:
        ks = {}
        for r in decoding:
            k = min(self.rng.randint(0, self.max_k), room(r, max_model_len))
            if k > 0:
                ks[r.request_id] = k
        return Plan(ks)

    def propose(self, req: Request, k: int) -> list[int] | None:
        if self.mode == "runner":
            return None
        return guess(self.target, req, self.rng.randint(0, k), self.rng)

    def observe(self, req: Request, num_draft: int, num_accepted: int) -> None:
        pass


class SpecFakeRunner:
    """Writes every scheduled token (drafts too) through the block tables and verifies the drafts.

    `deterministic`: the target is `target(history, sample_index)`; drafts are accepted while they equal
    the target's tokens, then the target's next token is sampled (so speculation changes nothing).
    Otherwise a random prefix of the drafts is accepted and the sampled token is random.
    """

    def __init__(self, kv: KVCacheManager, target, rng: random.Random, deterministic: bool) -> None:
        self.kv = kv
        self.target = target
        self.rng = rng
        self.deterministic = deterministic
        # How the runner makes drafts when the scheduler asks for them without proposing (draft model).
        self.make_drafts = lambda req, k: guess(self.target, req, k, self.rng)
        self.store: list[list[tuple[int, int, int] | None]] = [
            [None] * kv.block_size for _ in range(kv.num_blocks)
        ]
        self.active: dict[str, Request] = {}
        self.num_copies = 0

    def slot(self, req: Request, pos: int) -> tuple[int, int]:
        bs = self.kv.block_size
        return req.block_ids[pos // bs], pos % bs

    def check_read(self, req: Request, seq: list[int]) -> None:
        """The KV of every position of `seq`, read through the block table, is that of `seq`."""
        for pos in range(len(seq)):
            b, j = self.slot(req, pos)
            assert self.store[b][j] == (pos, seq[pos], ctx(seq, pos)), (
                f"{req.request_id}: KV at position {pos} is not that of its verified sequence"
            )

    def sample(self, seq: list[int], index: int) -> int:
        return self.target(seq, index) if self.deterministic else self.rng.randrange(VOCAB)

    def execute(self, sched: SchedulerOutput, proposed: dict[str, list[int]] | None) -> RunnerOutput:
        """`proposed`: the hook's proposals this step when the scheduler proposes; None when the runner does."""
        pool, bs = self.kv.pool, self.kv.block_size
        for rid in sched.finished_ids:
            self.active.pop(rid, None)
        for src, dst in sched.block_copies:
            assert pool.refcount(dst) == 1, "copy into a block that is free or shared"
            self.store[dst] = list(self.store[src])
            self.num_copies += 1
        out = RunnerOutput()
        for req, n in zip(sched.requests, sched.num_tokens):
            rid = req.request_id
            assert not req.is_finished
            assert self.active.setdefault(rid, req) is req
            k = sched.num_draft.get(rid, 0)
            start = req.num_computed_tokens
            if k:
                if proposed is not None:  # the scheduler proposed: the runner gets those, trimmed to k
                    drafts = sched.draft_tokens[rid]
                    assert drafts == proposed[rid][:k]
                else:
                    assert rid not in sched.draft_tokens
                    drafts = self.make_drafts(req, k)
                assert len(drafts) == k
            else:
                assert rid not in sched.draft_tokens
                drafts = []
            seq = req.token_ids + drafts
            assert len(req.block_ids) * bs >= start + n
            for pos in range(start, start + n):
                b, j = self.slot(req, pos)
                # Neither another request nor the prefix cache holds the block being written.
                assert pool.refcount(b) == 1, f"{rid} writes into shared block {b}"
                self.store[b][j] = (pos, seq[pos], ctx(seq, pos))
            if start + n < req.num_tokens:
                continue  # a prompt chunk that does not reach the end
            self.check_read(req, seq)
            if self.deterministic:
                a = 0
                while a < k and drafts[a] == self.target(seq[: req.num_tokens + a], req.sample_index):
                    a += 1
            else:
                a = self.rng.randint(0, k)
            if a:
                out.accepted[rid] = drafts[:a]
            out.sampled[rid] = self.sample(seq[: req.num_tokens + a], req.sample_index)
            for child in req.pending_children:
                assert k == 0 and child.token_ids == req.token_ids
                out.sampled[child.request_id] = self.sample(req.token_ids, child.sample_index)
        return out


class CheckedKV(KVCacheManager):
    """Checks, whenever blocks may go into the prefix cache, that they hold only verified tokens' KV."""

    runner: SpecFakeRunner

    def cache_computed(self, req: Request) -> None:
        assert req.num_computed_tokens <= req.num_tokens, "computed past the known tokens"
        full = req.num_computed_tokens // self.block_size * self.block_size
        self.runner.check_read(req, req.token_ids[:full])
        super().cache_computed(req)


def fits(kv: KVCacheManager, req: Request, n: int) -> bool:
    """Whether `allocate_slots(req, n)` can succeed now (new blocks plus copies of shared ones)."""
    start, end, table = req.num_computed_tokens, req.num_computed_tokens + n, req.block_ids
    last = min(len(table), kv.blocks_for(end))
    shared = sum(kv.pool.refcount(table[i]) > 1 for i in range(start // kv.block_size, last))
    return max(0, kv.blocks_for(end) - len(table)) + shared <= kv.num_available


class SpecCheckedScheduler(CheckedScheduler):
    """Drafts are optional: a request never waits for blocks, nor takes them from another request, for
    the sake of its drafts."""

    def _pick_victim(self, i: int) -> Request | None:
        req = self.running[i]
        if req.num_tokens - req.num_computed_tokens == 1:
            assert not fits(self.kv, req, 1), (
                f"{req.request_id} asks for a victim although its next token alone fits: for its drafts"
            )
        return super()._pick_victim(i)


@dataclass
class SpecHarness:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int = 64
    enable_prefix_caching: bool = False
    policy: str = "fcfs"
    mode: str | None = "scheduler"  # None: no speculation
    max_k: int = 4
    deterministic: bool = True
    seed: int = 0
    target: object = next_token
    spec: object = None  # a SpecHook to use instead of RandomDrafts
    members: dict[str, Request] = field(default_factory=dict)
    num_steps: int = 0
    num_drafted: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_rewound: int = 0  # verifies that rejected at least one draft
    num_extra_blocks: int = 0  # steps ending with a request holding blocks past what it computed

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.kv = CheckedKV(self.num_blocks, self.block_size, self.enable_prefix_caching)
        if self.spec is None and self.mode is not None:
            self.spec = RandomDrafts(self.mode, self.max_k, random.Random(rng.random()), self.target)
        self.sched = SpecCheckedScheduler(
            self.kv,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            config=SchedulingConfig(policy=self.policy),
            spec=self.spec,
        )
        self.runner = SpecFakeRunner(self.kv, self.target, random.Random(rng.random()), self.deterministic)
        self.kv.runner = self.runner
        self.planned: dict[str, int] = {}
        self.proposed: dict[str, list[int]] = {}
        self.observed: list[tuple[str, int, int]] = []
        if self.spec is not None:
            self._record(self.spec)

    def _record(self, spec) -> None:
        """Wrap the hook to record (and check) what the scheduler asks of it and tells it."""
        plan, propose, observe = spec.plan, spec.propose, spec.observe

        def recorded_plan(decoding: list[Request], other_tokens: int, max_model_len: int) -> Plan:
            for r in decoding:
                assert r.status == RequestStatus.RUNNING and not r.pending_children
                assert r.num_tokens - r.num_computed_tokens == 1, "drafts planned for a request not decoding"
            assert 0 <= other_tokens <= self.max_num_batched_tokens
            p = plan(decoding, other_tokens, max_model_len)
            self.planned, self.proposed = dict(p.num_draft), {}
            return p

        def recorded_propose(req: Request, k: int) -> list[int] | None:
            assert k == self.planned[req.request_id] > 0
            drafts = propose(req, k)
            if drafts is not None:
                assert self.mode == "scheduler" and len(drafts) <= k
                self.proposed[req.request_id] = list(drafts)
            return drafts

        def recorded_observe(req: Request, num_draft: int, num_accepted: int) -> None:
            self.observed.append((req.request_id, num_draft, num_accepted))
            observe(req, num_draft, num_accepted)

        spec.plan, spec.propose, spec.observe = recorded_plan, recorded_propose, recorded_observe

    def add(self, leader: Request, members: list[Request]) -> None:
        self.sched.add_request(leader)
        for m in members:
            self.members[m.request_id] = m
        self.check_state()

    def abort(self, rid: str) -> None:
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        self.check_state()

    # -- one step --------------------------------------------------------

    def step(self) -> SchedulerOutput:
        sched, kv, bs = self.sched, self.kv, self.block_size
        tables_before = {id(r): list(r.block_ids) for r in sched.running}
        out = sched.schedule()
        self.num_steps += 1
        planned = self.planned if self.spec is not None else {}
        proposed = self.proposed if self.mode == "scheduler" else None
        # -- the plan: budget with drafts, coverage, drafts only where planned
        assert out.total_tokens <= sched.max_num_batched_tokens, "drafts overran the token budget"
        assert len({id(r) for r in out.requests}) == len(out.requests)
        scheduled = {r.request_id for r in out.requests}
        assert set(out.num_draft) <= scheduled and set(out.draft_tokens) <= set(out.num_draft)
        copies = set(out.block_copies)
        for v in out.preempted:  # a victim of the priority policy may be readmitted in the same step
            tables_before.pop(id(v), None)
        for r, n in zip(out.requests, out.num_tokens):
            owed = r.num_tokens - r.num_computed_tokens
            k = out.num_draft.get(r.request_id, 0)
            assert n >= 1 and k >= 0
            if self.spec is None:
                assert k == 0
            if k:
                assert owed == 1 and n == 1 + k, "drafts on a request that is not decoding"
                assert not r.pending_children
                assert k <= room(r, self.max_model_len), "drafts past max_tokens or max_model_len"
                assert k <= planned[r.request_id], "more drafts than planned"
                if proposed is not None:
                    assert k <= len(proposed[r.request_id])
            else:
                assert n <= owed
            assert len(r.block_ids) * bs >= r.num_computed_tokens + n, "blocks do not cover the step"
            assert len(r.block_ids) == max(
                kv.blocks_for(r.num_computed_tokens + n), len(tables_before.get(id(r), ()))
            )
            before = tables_before.get(id(r))
            if before is not None:
                # Running since the last step: the table only grew, or a block was copied on write.
                assert len(r.block_ids) >= len(before), "a block table shrank while running"
                for i, b in enumerate(before):
                    if r.block_ids[i] != b:
                        assert (b, r.block_ids[i]) in copies, "a block was swapped without a copy"
        scheduled_ids = {id(r) for r in out.requests}
        for v in out.preempted:
            # Its blocks went back to the pool; a victim readmitted in the same step holds new ones
            # and starts over.
            assert v.num_computed_tokens == 0
            assert v.block_ids == [] or id(v) in scheduled_ids, "a preempted request kept its blocks"
        starts = {r.request_id: r.num_computed_tokens for r in out.requests}
        lengths = {r.request_id: r.num_tokens for r in out.requests}
        # -- the model
        result = self.runner.execute(out, proposed)
        if out.is_empty:
            return out
        tables = {r.request_id: list(r.block_ids) for r in out.requests}
        observed = len(self.observed)
        sched.update(out, result)
        # -- the rewind
        expect_observed = []
        for r, n in zip(out.requests, out.num_tokens):
            rid = r.request_id
            k = out.num_draft.get(rid, 0)
            a = len(result.accepted.get(rid, ()))
            assert a <= k
            if k:
                self.num_drafted += 1
                self.num_draft_tokens += k
                self.num_accepted += a
                self.num_rewound += a < k
                expect_observed.append((rid, k, a))
            if r.is_finished:
                assert r.block_ids == []
                continue
            if starts[rid] + n >= lengths[rid]:  # it sampled: accepted drafts kept, rejected ones rewound
                assert r.num_tokens == lengths[rid] + a + 1
                assert r.num_computed_tokens == r.num_tokens - 1 == starts[rid] + n - (k - a)
            else:
                assert r.num_computed_tokens == starts[rid] + n
            # update never frees a block; it may only switch one to the cache's copy of the same KV.
            before = tables[rid]
            assert len(r.block_ids) == len(before), "a rewind freed or took blocks"
            for i, b in enumerate(before):
                if r.block_ids[i] != b:
                    assert kv.cache is not None and i < r.prefix_node.end // bs  # type: ignore[union-attr]
            if len(r.block_ids) > kv.blocks_for(r.num_computed_tokens + 1):
                self.num_extra_blocks += 1
        assert self.observed[observed:] == expect_observed, "the hook was told other acceptances"
        self.check_state()
        return out

    # -- invariants ------------------------------------------------------

    def check_state(self) -> None:
        sched, kv, pool = self.sched, self.kv, self.kv.pool
        kv.check_invariants()
        running, waiting = sched.running, list(sched.waiting)
        pending = [c for r in running + waiting for c in r.pending_children]
        where = [id(r) for r in running + waiting + pending]
        assert len(where) == len(set(where))
        assert set(where) == {id(r) for r in sched.requests.values()}
        holders = Counter(b for r in running for b in r.block_ids)
        owned = self.check_tree(holders) if kv.cache is not None else set()
        for b in range(pool.num_blocks):
            assert pool.refcount(b) == holders[b] + (b in owned), f"block {b}: refcount drifted"
        for r in running:
            assert r.status == RequestStatus.RUNNING
            assert len(set(r.block_ids)) == len(r.block_ids)
            assert 0 < r.num_computed_tokens < r.num_tokens
            assert len(r.block_ids) >= kv.blocks_for(r.num_computed_tokens)
            # Drafts are capped by max_tokens: never more blocks than the request could ever need.
            assert len(r.block_ids) <= kv.blocks_for(r.num_prompt_tokens + r.max_tokens)
        for r in waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.prefix_node is None
        for r in self.members.values():
            if r.is_finished:
                assert r.block_ids == [] and r.prefix_node is None

    def check_tree(self, holders: Counter) -> set[int]:
        kv, cache, bs = self.kv, self.kv.cache, self.block_size
        assert cache is not None
        owned: set[int] = set()
        unlocked: set[int] = set()
        expected_lock: Counter = Counter()
        for r in self.sched.running:
            node = r.prefix_node
            assert isinstance(node, Node)
            assert node.end % bs == 0 and node.end <= r.num_computed_tokens
            assert path_tokens(node) == r.token_ids[: node.end], f"{r.request_id} locks a foreign path"
            assert r.block_ids[: node.end // bs] == path_blocks(node)
            while node.parent is not None:
                expected_lock[id(node)] += 1
                node = node.parent
        for n, _ in tree_nodes(kv):
            assert n.lock == expected_lock[id(n)]
            owned.update(n.blocks)
            if n.lock == 0:
                unlocked.update(n.blocks)
            # A cached block holds the KV of the verified tokens on its path, computed under that path.
            path = path_tokens(n)
            start = n.end - len(n.key)
            for i, b in enumerate(n.blocks):
                for j in range(bs):
                    pos = start + i * bs + j
                    assert self.runner.store[b][j] == (pos, path[pos], ctx(path, pos)), (
                        f"cached block {b} does not hold the KV of its path at position {pos}"
                    )
        assert len(owned) == cache.num_cached_blocks and len(unlocked) == cache.num_unlocked_blocks
        assert not unlocked & set(holders)
        return owned

    def run(
        self, arrivals: dict[int, list[tuple[Request, list[Request]]]], aborts=(), max_steps=2000
    ) -> None:
        ids = [m.request_id for groups in arrivals.values() for _, ms in groups for m in ms]
        last = max(arrivals, default=0)
        step = 0
        while True:
            for leader, members in arrivals.get(step, []):
                self.add(leader, members)
            if step > last and not self.sched.has_unfinished():
                break
            assert step < max_steps, "no progress: livelock"
            self.step()
            for at, i in aborts:
                if at == step:
                    self.abort(ids[i % len(ids)])
            step += 1
        self.check_end()

    def check_end(self) -> None:
        out = self.sched.schedule()
        assert out.is_empty and not out.preempted and not out.block_copies
        self.runner.execute(out, None)
        assert not self.sched.has_unfinished() and self.sched.requests == {}
        kv, cache = self.kv, self.kv.cache
        kv.check_invariants()
        for r in self.members.values():
            assert r.is_finished and r.block_ids == []
        if cache is not None:
            self.check_state()
            assert all(n.lock == 0 for n, _ in tree_nodes(kv))
            assert kv.usage == 0.0 and cache.num_unlocked_blocks == cache.num_cached_blocks
            assert kv.pool.num_free + cache.num_cached_blocks == kv.num_blocks, "KV blocks leaked"
            cache.evict(kv.num_blocks)
            assert cache.num_cached_blocks == 0
        assert kv.pool.num_free == kv.num_blocks, "KV blocks leaked"

    def outputs(self) -> dict[str, list[int]]:
        return {rid: r.output_token_ids for rid, r in self.members.items()}


# -- random workloads --------------------------------------------------------


@dataclass(frozen=True)
class Group:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    stop_mode: str  # "ignore_eos", "eos" or "stop_token"
    stop: int
    min_tokens: int
    arrival: int
    priority: int

    def build(self) -> tuple[Request, list[Request]]:
        return make_group(
            self.rid,
            list(self.prompt),
            self.max_tokens,
            self.n,
            ignore_eos=self.stop_mode != "eos",
            eos=(self.stop,),
            stop_token_ids=[self.stop] if self.stop_mode == "stop_token" else None,
            min_tokens=self.min_tokens,
            priority=self.priority,
            arrival_time=float(self.arrival),
        )


@dataclass(frozen=True)
class Case:
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    extra_blocks: int
    prefix_caching: bool
    policy: str
    max_k: int
    groups: tuple[Group, ...]
    aborts: tuple[tuple[int, int], ...]
    max_model_len: int = 64

    def num_blocks(self) -> int:
        need = max(-(-(len(g.prompt) + g.max_tokens) // self.block_size) for g in self.groups)
        return need + self.extra_blocks

    def arrivals(self) -> dict[int, list[tuple[Request, list[Request]]]]:
        out: dict[int, list] = {}
        for g in self.groups:
            out.setdefault(g.arrival, []).append(g.build())
        return out


@st.composite
def cases(draw) -> Case:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 5))
    # Prompts from a few shared stems (prefix-cache hits) with repetition (so drafts can be right).
    stems = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=12)) for _ in range(2)]
    groups = []
    for i in range(draw(st.integers(1, 6))):
        stem = stems[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
        prompt = (stem + tail * draw(st.integers(1, 2)))[:30]
        max_tokens = draw(st.integers(1, 16))
        groups.append(
            Group(
                rid=f"g{i}",
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                n=min(max_num_seqs, draw(st.sampled_from([1, 1, 1, 2, 3]))),
                stop_mode=draw(st.sampled_from(["ignore_eos", "ignore_eos", "eos", "stop_token"])),
                stop=draw(st.integers(0, VOCAB - 1)),
                min_tokens=draw(st.integers(0, max_tokens)),
                arrival=draw(st.integers(0, 6)),
                priority=draw(st.integers(0, 2)),
            )
        )
    return Case(
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=max_num_seqs,
        extra_blocks=draw(st.sampled_from([0, 1, 2, 4, 64])),
        prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "fcfs", "priority", "lpm"])),
        max_k=draw(st.integers(1, 6)),
        groups=tuple(groups),
        aborts=tuple(draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 50)), max_size=2))),
    )


def harness(c: Case, mode: str | None, deterministic: bool = True, seed: int = 0) -> SpecHarness:
    return SpecHarness(
        c.num_blocks(),
        c.block_size,
        c.max_num_seqs,
        c.max_num_batched_tokens,
        c.max_model_len,
        enable_prefix_caching=c.prefix_caching,
        policy=c.policy,
        mode=mode,
        max_k=c.max_k,
        deterministic=deterministic,
        seed=seed,
    )


def report(h: SpecHarness) -> None:
    if h.sched.num_preemptions:
        event("preempted")
    if h.num_rewound:
        event("rejected drafts rewound")
    if h.num_accepted:
        event("drafts accepted")
    if h.num_extra_blocks:
        event("blocks held past the computed tokens after a rewind")
    if h.runner.num_copies:
        event("copy-on-write")
    if h.kv.cache is not None and h.kv.num_hit_tokens:
        event("prefix-cache hit")


@settings(max_examples=150, deadline=None)
@given(c=cases(), mode=st.sampled_from(["scheduler", "runner"]), seed=st.integers(0, 2**32 - 1))
def test_random_drafts_keep_outputs_and_kv_invariants(c: Case, mode: str, seed: int) -> None:
    """Deterministic target: with random drafts proposed in the scheduler (n-gram style) or in the runner
    (draft-model style), every invariant holds every step, and the outputs equal the run without
    speculation and the reference computed without any scheduler."""
    plain = harness(c, None)
    plain.run(c.arrivals(), c.aborts)
    spec = harness(c, mode, seed=seed)
    spec.run(c.arrivals(), c.aborts)
    for rid, r in spec.members.items():
        want = reference(next_token, r, c.max_model_len)
        if RequestStatus.FINISHED_ABORTED in (r.status, plain.members[rid].status):
            # Aborted at a fixed step: speculation may have got further; the tokens are still the target's.
            assert r.output_token_ids == want[: r.num_output_tokens]
        else:
            assert r.output_token_ids == want == plain.members[rid].output_token_ids
            assert r.status == plain.members[rid].status
    report(spec)


@settings(max_examples=80, deadline=None)
@given(c=cases(), mode=st.sampled_from(["scheduler", "runner"]), seed=st.integers(0, 2**32 - 1))
def test_random_acceptance_keeps_kv_invariants(c: Case, mode: str, seed: int) -> None:
    """A runner that accepts a random prefix of the drafts and samples random tokens: every invariant
    holds every step (the KV read back for every verified token is that of the request's tokens)."""
    h = harness(c, mode, deterministic=False, seed=seed)
    h.run(c.arrivals(), c.aborts)
    for r in h.members.values():
        assert r.num_output_tokens <= r.max_tokens
    report(h)


# -- targeted scenarios --------------------------------------------------------


def periodic(history: list[int], index: int) -> int:
    """A target that repeats the prompt's period-3 pattern, so n-gram lookup is usually right."""
    return history[-3] if len(history) >= 3 else (history[-1] + 1) % VOCAB


@pytest.mark.parametrize("mode", ["scheduler", "runner"])
def test_rewinds_keep_blocks_and_preemption_still_recomputes(mode: str) -> None:
    """A tight cache with block size 2 and up to 5 drafts: rejected drafts leave blocks allocated past
    the computed tokens (reused by the next step, not freed), requests are preempted and recompute,
    the prefix cache is hit, and the outputs are the target's."""
    c = Case(
        block_size=2,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        extra_blocks=4,
        prefix_caching=True,
        policy="fcfs",
        max_k=5,
        groups=tuple(
            # g1: two samples forked off a prompt ending mid-block (copy-on-write).
            Group(
                f"g{i}",
                (1, 2, 3, 4, 5, 6, i, i + 1)[: 7 if i == 1 else 8],
                14,
                2 if i == 1 else 1,
                "ignore_eos",
                0,
                0,
                i,
                0,
            )
            for i in range(5)
        ),
        aborts=(),
    )
    h = harness(c, mode, seed=3)
    h.run(c.arrivals())
    assert h.sched.num_preemptions > 0
    assert h.num_rewound > 0 and h.num_accepted > 0
    assert h.num_extra_blocks > 0
    assert h.kv.num_hit_tokens > 0
    assert h.runner.num_copies > 0
    for r in h.members.values():
        assert r.output_token_ids == reference(next_token, r, c.max_model_len)


def test_stop_inside_accepted_drafts_caches_only_kept_tokens() -> None:
    """The target emits the stop token in the middle of an all-correct draft: the tokens after it are
    dropped, `num_computed_tokens` is clamped to the kept tokens and only they reach the prefix cache."""
    stop = 20

    def target(history: list[int], index: int) -> int:
        return stop if len(history) == 10 else (history[-1] + 1) % VOCAB

    class AlwaysSix(RandomDrafts):
        def plan(self, decoding, other_tokens, max_model_len):
            return Plan(
                {r.request_id: min(6, room(r, max_model_len)) for r in decoding if room(r, max_model_len)}
            )

    h = SpecHarness(
        num_blocks=16,
        block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        mode="runner",
        target=target,
        spec=AlwaysSix("runner", 6, random.Random(0), target),
    )
    # The "draft model" is always right.
    h.runner.make_drafts = lambda req, k: continuation(target, req.token_ids, req.sample_index, k)
    h.add(*make_group("a", [1, 2, 3, 4, 5, 6], max_tokens=12, stop_token_ids=[stop]))
    h.step()  # the prompt
    out = h.step()  # 6 drafts, all accepted; the 4th is the stop token
    a = h.members["a"]
    assert out.num_draft == {"a": 6}
    assert a.output_token_ids == [7, 8, 9, 10, stop]
    assert a.status == RequestStatus.FINISHED_STOPPED
    # Cached: the full blocks of the kept tokens but the last (never fed back), none of the 2 dropped.
    cached = max((path_tokens(n) for n, _ in tree_nodes(h.kv)), key=len)
    assert cached == a.token_ids[:10]
    h.check_end()


class MaxDrafts(RandomDrafts):
    """Always asks for as many drafts as may be kept."""

    def plan(self, decoding, other_tokens, max_model_len):
        ks = {r.request_id: min(self.max_k, room(r, max_model_len)) for r in decoding}
        return Plan({rid: k for rid, k in ks.items() if k > 0})


def test_drafts_are_dropped_rather_than_preempting() -> None:
    """`a`'s 3 drafts would need 2 more blocks, only 1 is free: it decodes without drafts, and `b`, which
    holds the other block, is not preempted for them."""
    h = SpecHarness(
        num_blocks=4,
        block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        mode="runner",
        spec=MaxDrafts("runner", 4, random.Random(0), next_token),
    )
    h.add(*make_group("a", [1, 2, 3], max_tokens=5))
    h.add(*make_group("b", [4], max_tokens=2))
    h.step()  # both prompts: a holds 2 blocks, b 1
    assert h.kv.pool.num_free == 1
    out = h.step()
    assert not out.preempted and h.sched.num_preemptions == 0
    assert [r.request_id for r in out.requests] == ["a", "b"] and out.num_tokens == [1, 1]
    assert out.num_draft == {} and out.draft_tokens == {}
    while h.sched.has_unfinished():
        h.step()
    h.check_end()
    assert h.num_draft_tokens > 0  # once b is done, a drafts again
    for r in h.members.values():
        assert r.output_token_ids == reference(next_token, r, h.max_model_len)


class OtherTokens(RandomDrafts):
    """Records the `other_tokens` of every plan."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[int] = []

    def plan(self, decoding: list[Request], other_tokens: int, max_model_len: int) -> Plan:
        self.seen.append(other_tokens)
        return super().plan(decoding, other_tokens, max_model_len)


def test_plan_counts_the_prompts_this_step_admits() -> None:
    """Drafts are planned before the queue is admitted: a step that will also admit a prompt must
    not look like a pure-decode step to the plan (the adaptive controller drafts only in those)."""
    spec = OtherTokens("scheduler", 2, random.Random(0), next_token)
    h = SpecHarness(
        num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, mode="scheduler", spec=spec
    )
    h.add(*make_group("a", [1, 2, 3], max_tokens=6))
    h.step()  # a's prompt; nothing decoding yet, so no plan
    h.add(*make_group("b", [4, 5, 6, 7, 8], max_tokens=3))
    h.add(*make_group("c", [9, 9], max_tokens=3))
    out = h.step()  # a decodes, b is admitted (a free seat), c waits (no seat)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert spec.seen[-1] == 5
    out = h.step()  # both decode, c still has no seat: a pure-decode step
    assert "c" not in [r.request_id for r in out.requests]
    assert spec.seen[-1] == 0
    while h.sched.has_unfinished():
        h.step()
    h.check_end()


def test_real_planner_ngram_counters() -> None:
    """The real SpecPlanner (n-gram, adaptive off) in the scheduler over a periodic target: n-gram drafts
    are accepted, the outputs are the target's, and the planner's counters add up."""
    planner = SpecPlanner(
        SpeculativeConfig.from_dict(
            {
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 3,
                "adaptive": False,
            }
        )
    )
    h = SpecHarness(
        num_blocks=14,
        block_size=2,
        max_num_seqs=3,
        max_num_batched_tokens=10,
        enable_prefix_caching=True,
        mode="scheduler",
        target=periodic,
        spec=planner,
    )
    arrivals = {
        i: [make_group(f"r{i}", [i, 5, 9, 1, 2, 3, 1, 2, 3][: 4 + i], max_tokens=12 + i)] for i in range(4)
    }
    h.run(arrivals)
    for r in h.members.values():
        assert r.output_token_ids == reference(periodic, r, h.max_model_len)
    assert planner.num_draft_tokens == h.num_draft_tokens > 0
    assert planner.num_accepted_tokens == h.num_accepted > 0
    assert planner.num_drafts == h.num_drafted
    assert sum(planner.accepted_per_pos) == planner.num_accepted_tokens
    assert all(x >= y for x, y in zip(planner.accepted_per_pos, planner.accepted_per_pos[1:]))
    assert h.sched.num_preemptions > 0


def test_speculative_config_takes_vllm_keys() -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = SpeculativeConfig.from_dict(ngram)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.adaptive) == (1, 4, True)
    # As vLLM: one bound alone sets the other (a lone minimum above the default maximum is valid).
    cfg = SpeculativeConfig.from_dict({**ngram, "prompt_lookup_min": 5})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = SpeculativeConfig.from_dict({**ngram, "prompt_lookup_max": 2, "prompt_lookup_min": None})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)
    cfg = SpeculativeConfig.from_dict({**ngram, "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 3)
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.from_dict({**ngram, "prompt_lookup_min": 4, "prompt_lookup_max": 3})
    draft = SpeculativeConfig.from_dict(
        {"model": "/some/dir", "num_speculative_tokens": 2, "adaptive": False}
    )
    assert (draft.method, draft.model, draft.adaptive) == ("draft_model", "/some/dir", False)
    for bad in ({**ngram, "num_speculative_tokens": 0}, {**ngram, "method": "eagle"}, {**ngram, "typo": 1}):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_dict(bad)


def test_adaptive_settings_come_from_speculative_config() -> None:
    """`adaptive` is true, false or a dict of the controller's settings (adaptive, with those set);
    a bad setting is a ValueError naming it."""
    from tandem.spec.config import AdaptiveConfig

    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    for flag in (True, False):
        cfg = SpeculativeConfig.from_dict({**ngram, "adaptive": flag})
        assert cfg.adaptive is flag and cfg.adaptive_config == AdaptiveConfig()
    cfg = SpeculativeConfig.from_dict({**ngram, "adaptive": {"explore_z": 1.0, "min_samples": 5}})
    assert cfg.adaptive and (cfg.adaptive_config.explore_z, cfg.adaptive_config.min_samples) == (1.0, 5)
    assert SpecPlanner(cfg).controller.gate.config.min_samples == 5
    for bad, field_name in (
        ({"explore_z": -1}, "explore_z"),
        ({"gate_decay": 1.5}, "gate_decay"),
        ({"min_samples": 0}, "min_samples"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"history_decay": True}, "history_decay"),
        ({"explore_every": 300}, "max_explore"),
        ({"seed_context": 1}, "seed_context"),
        ({"typo": 1}, "typo"),
    ):
        with pytest.raises(ValueError, match=field_name):
            SpeculativeConfig.from_dict({**ngram, "adaptive": bad})
    with pytest.raises(ValueError, match=r"speculative_config\.adaptive must be"):
        SpeculativeConfig.from_dict({**ngram, "adaptive": "yes"})
