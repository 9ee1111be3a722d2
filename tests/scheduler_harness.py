"""A fake model runner and a checking harness for scheduler tests (no torch, no model).

The fake runner keeps a simulated paged KV cache: each slot holds the (position, token) that was
written there. It performs the step's copy-on-write copies, writes every scheduled token through the
request's block table (refusing to write into a block that another request or the prefix cache still
holds), and, for a request that has caught up, reads its whole history back through the block table and
samples a token that depends only on that history. A paging, copy-on-write, recompute or prefix-cache
bug therefore shows up as a runner assertion or as tokens that differ from a reference computed
without any scheduler.

`Harness` drives a scheduler step by step and checks, after every step, the queues, the block
accounting (refcount = holders in live block tables + 1 if the prefix cache owns the block), the
prefix-cache tree (locks, ownership, the KV its blocks hold) and the step's plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.policy import SchedulingConfig
from tandem.core.prefix_cache import Node
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.sampling_params import SamplingParams

VOCAB = 29


def next_token(history: list[int], sample_index: int) -> int:
    """A deterministic 'model': the next token depends only on the history (and which sample it is)."""
    h = 0x9E3779B1 * (sample_index + 1) + len(history)
    for t in history:
        h = (h * 1_000_003 + t + 1) & 0xFFFFFFFFFFFF
    return (h >> 7) % VOCAB


def reference_output(
    prompt: list[int],
    sp: SamplingParams,
    max_tokens: int,
    eos: tuple[int, ...],
    index: int,
    max_model_len: int,
) -> tuple[list[int], RequestStatus]:
    """What one sample must produce, computed without a scheduler or KV cache."""
    toks = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(toks, index)
        toks.append(t)
        out.append(t)
        if len(out) > sp.min_tokens:
            if not sp.ignore_eos and t in eos:
                return out, RequestStatus.FINISHED_STOPPED
            if t in sp.stop_token_ids:
                return out, RequestStatus.FINISHED_STOPPED
        if len(out) >= max_tokens or len(toks) >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH


def make_group(
    rid: str,
    prompt: list[int],
    max_tokens: int,
    n: int = 1,
    *,
    ignore_eos: bool = True,
    eos: tuple[int, ...] = (),
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    **request_fields,
) -> tuple[Request, list[Request]]:
    """A leader with n - 1 pending children, as the engine builds them.

    `request_fields` (priority, tenant, cache_salt, arrival_time) go to every member.
    """
    sp = SamplingParams(
        n=n,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
        min_tokens=min_tokens,
    )
    members = [
        Request(
            rid if i == 0 else f"{rid}#{i}",
            list(prompt),
            sp,
            max_tokens,
            eos_token_ids=eos,
            group_id=rid,
            sample_index=i,
            **request_fields,
        )
        for i in range(n)
    ]
    members[0].pending_children = members[1:]
    return members[0], members


class FakeRunner:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        bs = kv.block_size
        self.store: list[list[tuple[int, int] | None]] = [[None] * bs for _ in range(kv.num_blocks)]
        self.active: dict[str, Request] = {}  # per-request state a real runner would keep
        self.num_copies = 0

    def read(self, req: Request, upto: int) -> list[int]:
        bs = self.kv.block_size
        out = []
        for pos in range(upto):
            slot = self.store[req.block_ids[pos // bs]][pos % bs]
            assert slot is not None and slot[0] == pos, (
                f"{req.request_id}: KV slot for position {pos} is {slot}"
            )
            out.append(slot[1])
        return out

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        pool = self.kv.pool
        bs = self.kv.block_size
        for rid in sched.finished_ids:
            self.active.pop(rid, None)
        for src, dst in sched.block_copies:
            assert pool.refcount(dst) == 1, "copy into a block that is free or shared"
            self.store[dst] = list(self.store[src])
            self.num_copies += 1
        sampled: dict[str, int] = {}
        for req, n in zip(sched.requests, sched.num_tokens):
            assert not req.is_finished, f"finished request {req.request_id} scheduled"
            prev = self.active.setdefault(req.request_id, req)
            assert prev is req, f"{req.request_id} reused before the runner was told the old one finished"
            start = req.num_computed_tokens
            assert len(req.block_ids) * bs >= start + n
            for pos in range(start, start + n):
                block = req.block_ids[pos // bs]
                # Refcount 1: neither another request nor the prefix cache holds the block being written.
                assert pool.refcount(block) == 1, f"{req.request_id} writes into shared block {block}"
                self.store[block][pos % bs] = (pos, req.token_ids[pos])
            if start + n == req.num_tokens:
                history = self.read(req, req.num_tokens)
                assert history == req.token_ids, f"{req.request_id} would attend to the wrong KV"
                sampled[req.request_id] = next_token(history, req.sample_index)
                for child in req.pending_children:
                    assert child.token_ids == req.token_ids
                    sampled[child.request_id] = next_token(history, child.sample_index)
        return RunnerOutput(sampled=sampled)


class CheckedScheduler(Scheduler):
    """Checks every victim choice against the documented victim rules and counts the outcomes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.protected_victims = 0
        self.stalls = 0
        self.priority_victims: list[tuple[Request, Request]] = []  # (victim, the request it made room for)

    def _pick_victim(self, i: int) -> Request | None:
        victim = super()._pick_victim(i)
        req = self.running[i]
        # running[:i] were scheduled this step already: they are never victims.
        assert victim is None or any(victim is r for r in self.running[i:])
        unprotected = [r for r in self.running[i + 1 :] if not r.protected]
        if unprotected:
            assert victim is unprotected[-1], "the victim must be the latest unprotected request"
        elif not req.protected:
            assert victim is req, "with every later request protected, the asking request gives way"
        elif i > 0:
            assert victim is None, "a protected request must wait rather than be preempted"
            self.stalls += 1
        else:
            assert victim is self.running[-1]
        if victim is not None and victim.protected:
            # Unavoidable only when every running request is protected and the first cannot go on.
            assert all(r.protected for r in self.running)
            self.protected_victims += 1
        return victim

    def _preempt_for(self, cand: Request, out: SchedulerOutput, now: float) -> None:
        before = len(out.preempted)
        running_before = list(self.running)
        super()._preempt_for(cand, out, now)
        for victim in out.preempted[before:]:
            assert self.config.policy == "priority"
            assert any(victim is r for r in running_before)
            assert victim.priority > cand.priority, "preempted a request of equal or higher priority"
            assert victim.num_output_tokens >= victim.protected_until_outputs - 1
            self.priority_victims.append((victim, cand))


def tree_nodes(kv: KVCacheManager) -> list[tuple[Node, str | None]]:
    """Every non-root node of the prefix cache, with the salt of its tree."""
    out = []
    assert kv.cache is not None
    for salt, root in kv.cache.roots.items():
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            out.append((n, salt))
            stack.extend(n.children.values())
    return out


def path_tokens(node: Node) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for key in reversed(parts) for t in key]


def path_blocks(node: Node) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.blocks)
        node = node.parent
    return [b for blocks in reversed(parts) for b in blocks]


@dataclass
class Harness:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int = 64
    enable_prefix_caching: bool = False
    config: SchedulingConfig | None = None
    clock: Callable[[], float] | None = None
    kv: KVCacheManager = field(init=False)
    sched: CheckedScheduler = field(init=False)
    runner: FakeRunner = field(init=False)
    members: dict[str, Request] = field(default_factory=dict)
    finished_reported: Counter = field(default_factory=Counter)
    id_uses: Counter = field(default_factory=Counter)
    resumed_unsampled: set[str] = field(default_factory=set)
    num_steps: int = 0
    num_thrash: int = 0
    num_chunked: int = 0
    num_mixed: int = 0
    outputs: list[SchedulerOutput] = field(default_factory=list)
    keep_outputs: bool = False
    # Prefix caching: every block-aligned prefix computed so far, per cache salt (what an ideal cache that
    # never evicts would hold), and for every admission (request id, tokens matched, ideal match).
    computed_prefixes: dict[str | None, set[tuple[int, ...]]] = field(default_factory=dict)
    admissions: list[tuple[str, int, int]] = field(default_factory=list)
    num_evictions: int = 0

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        kwargs = {} if self.clock is None else {"clock": self.clock}
        self.sched = CheckedScheduler(
            self.kv,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            config=self.config,
            **kwargs,
        )
        self.runner = FakeRunner(self.kv)
        if self.kv.cache is not None:
            cache = self.kv.cache
            evict = cache.evict

            def counting_evict(num_blocks: int) -> int:
                freed = evict(num_blocks)
                self.num_evictions += freed
                return freed

            cache.evict = counting_evict  # type: ignore[method-assign]

    def add(self, leader: Request, members: list[Request]) -> None:
        self.sched.add_request(leader)
        for m in members:
            self.members[m.request_id] = m
            self.id_uses[m.request_id] += 1
        self.check_state()

    def ideal_match(self, req: Request) -> int:
        """Tokens an ideal prefix cache (never evicting) would give `req` now."""
        bs = self.block_size
        seen = self.computed_prefixes.get(req.cache_salt, set())
        k = (req.num_tokens - 1) // bs
        while k > 0 and tuple(req.token_ids[: k * bs]) not in seen:
            k -= 1
        return k * bs

    def check_state(self) -> None:
        sched, kv, pool = self.sched, self.kv, self.kv.pool
        kv.check_invariants()
        running = sched.running
        waiting = list(sched.waiting)
        pending = [c for r in running + waiting for c in r.pending_children]
        where = [id(r) for r in running + waiting + pending]
        assert len(where) == len(set(where)), "a request is in two places at once"
        assert set(where) == {id(r) for r in sched.requests.values()}, "live requests and queues disagree"
        for rid, r in sched.requests.items():
            assert r.request_id == rid and not r.is_finished
            assert self.members.get(rid) is r
        # Every reference to a block is held by exactly one live request's block table, or by the cache.
        holders = Counter(b for r in running for b in r.block_ids)
        owned = self.check_tree(holders) if kv.cache is not None else set()
        for b in range(pool.num_blocks):
            assert pool.refcount(b) == holders[b] + (b in owned), (
                f"block {b}: refcount {pool.refcount(b)}, {holders[b]} holders, cached: {b in owned}"
            )
        # Conservation: free + cached only + held by requests == all blocks.
        assert pool.num_free + len(owned - set(holders)) + len(holders) == pool.num_blocks
        assert sum(r.num_seats for r in running) <= sched.max_num_seqs
        # A step admits only after serving every running request in full (each then samples), and
        # only the last request it admits can be left partly computed: so at most one running request
        # is ever protected, and a protected request never has to preempt another protected one.
        assert sum(r.protected for r in running) <= 1
        for r in running:
            assert r.status == RequestStatus.RUNNING
            assert len(set(r.block_ids)) == len(r.block_ids)
            assert 0 < r.num_computed_tokens < r.num_tokens, "a running request with nothing to do"
            assert len(r.block_ids) == kv.blocks_for(r.num_computed_tokens)
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.prefix_node is None
            assert (r.status == RequestStatus.PREEMPTED) == (r.num_preemptions > 0)
        for c in pending:
            assert c.status == RequestStatus.WAITING
            assert c.block_ids == [] and c.num_computed_tokens == 0 and c.num_output_tokens == 0
            assert c.prefix_node is None
        for r in self.members.values():
            if r.is_finished:
                assert r.block_ids == [] and r.pending_children == [] and r.prefix_node is None
                assert r.request_id not in sched.requests

    def check_tree(self, holders: Counter) -> set[int]:
        """Check the prefix cache against the live requests and the KV store; return the blocks it owns."""
        kv, cache, bs = self.kv, self.kv.cache, self.block_size
        assert cache is not None
        nodes = tree_nodes(kv)
        owned: set[int] = set()
        unlocked: set[int] = set()
        expected_lock: Counter = Counter()
        for r in self.sched.running:
            node = r.prefix_node
            assert isinstance(node, Node), f"running {r.request_id} has no prefix-cache node"
            assert node.end % bs == 0 and node.end <= r.num_computed_tokens
            assert path_tokens(node) == r.token_ids[: node.end], f"{r.request_id} locks a foreign path"
            # It reads the cached blocks of the path it locks (no private duplicate of cached KV).
            assert r.block_ids[: node.end // bs] == path_blocks(node), f"{r.request_id} duplicates cached KV"
            top = node
            while top.parent is not None:
                expected_lock[id(top)] += 1
                top = top.parent
            assert top is cache.roots[r.cache_salt], f"{r.request_id} locks a node of another salt's tree"
        for n, _ in nodes:
            assert n.lock == expected_lock[id(n)], (
                "a node's lock count is not the number of requests under it"
            )
            owned.update(n.blocks)
            if n.lock == 0:
                unlocked.update(n.blocks)
            # The KV a cached block holds is the KV of the tokens on its path: never overwritten.
            start = n.end - len(n.key)
            for i, b in enumerate(n.blocks):
                for j in range(bs):
                    pos = start + i * bs + j
                    assert self.runner.store[b][j] == (pos, n.key[i * bs + j]), (
                        f"cached block {b} lost its KV at position {pos}"
                    )
        assert len(owned) == cache.num_cached_blocks and len(unlocked) == cache.num_unlocked_blocks
        for r in self.sched.running:
            # Cached blocks a request holds all lie on the path it locks.
            assert not owned & set(r.block_ids[r.prefix_node.end // bs :]), (  # type: ignore[union-attr]
                f"{r.request_id} holds cached blocks beyond the path it locks"
            )
        # Idle cached blocks are held by no request, so eviction really releases them.
        assert not unlocked & set(holders), "an unlocked cached block is in a live block table"
        assert kv.num_available == kv.pool.num_free + len(unlocked)
        held = set(holders) | (owned - unlocked)
        assert abs(kv.usage - len(held) / kv.num_blocks) < 1e-9
        return owned

    def step(self) -> SchedulerOutput:
        sched = self.sched
        before_running = [id(r) for r in sched.running]
        stalls_before = sched.stalls
        priority_before = len(sched.priority_victims)
        unprotected_before = [r for r in sched.running if not r.protected]
        had_work = sched.has_unfinished()
        out = sched.schedule()
        self.num_steps += 1
        if self.keep_outputs:
            self.outputs.append(out)
        # -- the step's plan
        assert len(out.requests) == len(out.num_tokens)
        assert len({id(r) for r in out.requests}) == len(out.requests), "a request scheduled twice"
        assert all(n >= 1 for n in out.num_tokens)
        assert out.total_tokens <= sched.max_num_batched_tokens
        if had_work:
            assert not out.is_empty, "requests are pending but the step does nothing"
        assert sum(r.num_seats for r in sched.running) <= sched.max_num_seqs
        for r, n in zip(out.requests, out.num_tokens):
            assert any(r is x for x in sched.running)
            assert r.status == RequestStatus.RUNNING
            assert r.num_computed_tokens + n <= r.num_tokens
            assert len(r.block_ids) * self.kv.block_size >= r.num_computed_tokens + n
            assert len(r.block_ids) == self.kv.blocks_for(r.num_computed_tokens + n)
        scheduled_ids = {id(r) for r in out.requests}
        preempted_ids = {id(r) for r in out.preempted}
        num_priority = len(sched.priority_victims) - priority_before
        assert [v for v, _ in sched.priority_victims[priority_before:]] == out.preempted[:num_priority]
        left_waiting = [r for r in sched.running if id(r) not in scheduled_ids]
        if out.total_tokens < sched.max_num_batched_tokens:
            # Not for lack of budget: such a request waits for blocks, which only a protected one may do.
            assert all(r.protected for r in left_waiting), "an unprotected request was skipped"
        if len(out.preempted) > num_priority or sched.stalls > stalls_before:
            # Blocks are short: new requests would only take them from those already running.
            assert all(id(r) in before_running for r in out.requests), (
                "admitted a request while short of blocks"
            )
        if any(v.request_id in self.resumed_unsampled for v in out.preempted):
            # A resumed request lost its progress again: only when no unprotected request could give way.
            assert all(id(r) in preempted_ids for r in unprotected_before)
        made_room_for = {id(v): c for v, c in sched.priority_victims[priority_before:]}
        for v in out.preempted:
            if any(v is r for r in sched.running):
                # Readmitted at once: only a priority victim, with the room left once the request it made
                # room for was admitted (preemption frees a whole request, which may be more than needed).
                cand = made_room_for[id(v)]
                pos = [id(r) for r in out.requests]
                assert id(cand) in pos and pos.index(id(cand)) < pos.index(id(v)), "a pointless preemption"
                assert v.status == RequestStatus.RUNNING
            else:
                assert (
                    v.status == RequestStatus.PREEMPTED and v.block_ids == [] and v.num_computed_tokens == 0
                )
                assert any(v is w for w in sched.waiting)
            assert v.protected
            if v.request_id in self.resumed_unsampled:
                self.num_thrash += 1
            self.resumed_unsampled.add(v.request_id)
        for rid in out.finished_ids:
            self.finished_reported[rid] += 1
        is_prefill = [
            r.num_computed_tokens + n < r.num_prompt_tokens for r, n in zip(out.requests, out.num_tokens)
        ]
        is_decode = [r.num_computed_tokens >= r.num_prompt_tokens for r in out.requests]
        if any(is_prefill):
            self.num_chunked += 1
            if any(is_decode):
                self.num_mixed += 1
        for r in out.requests:
            if id(r) not in before_running or id(r) in preempted_ids:
                # Admitted this step: what it was given from the cache, against what an ideal cache holds.
                matched, ideal = r.num_computed_tokens, self.ideal_match(r)
                if self.kv.cache is None:
                    assert matched == 0
                else:
                    assert matched % self.block_size == 0 and matched < r.num_tokens
                    assert matched <= ideal, f"{r.request_id} matched KV that was never computed"
                    if r.num_preemptions == 0:
                        assert r.num_cached_tokens == matched
                self.admissions.append((r.request_id, matched, ideal))
        # -- the model
        result = self.runner.execute(out)
        if not out.is_empty:
            changed = sched.update(out, result)
            assert len({id(r) for r in changed}) == len(changed)
            for r in changed:
                self.resumed_unsampled.discard(r.request_id)
                assert r.num_output_tokens >= 1
        bs = self.block_size
        for r in out.requests:
            seen = self.computed_prefixes.setdefault(r.cache_salt, set())
            for k in range(r.num_computed_tokens // bs, 0, -1):
                key = tuple(r.token_ids[: k * bs])
                if key in seen:
                    break
                seen.add(key)
        self.check_state()
        return out

    def finish(self, rids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.sched.finish_requests(rids, status)
        self.check_state()

    def drain(self, max_steps: int) -> None:
        while self.sched.has_unfinished():
            assert self.num_steps < max_steps, "no progress: the scheduler is livelocked"
            self.step()
        self.check_end()

    def check_end(self, evict: bool = False) -> None:
        """Everything finished and reported once; every lock is back to zero, and with `evict` the
        cache is emptied (which must free every block)."""
        out = self.sched.schedule()  # hands out the last finished ids
        assert out.is_empty and not out.preempted and not out.block_copies
        for rid in out.finished_ids:
            self.finished_reported[rid] += 1
        self.runner.execute(out)
        assert not self.sched.has_unfinished()
        assert self.sched.requests == {}
        cache = self.kv.cache
        if cache is not None:
            self.check_state()
            # Every lock is back to zero; whatever is not free is idle in the cache and can be evicted.
            assert all(n.lock == 0 for n, _ in tree_nodes(self.kv))
            assert cache.num_unlocked_blocks == cache.num_cached_blocks
            assert self.kv.pool.num_free + cache.num_cached_blocks == self.kv.num_blocks, "KV blocks leaked"
            assert self.kv.usage == 0.0 and self.kv.num_available == self.kv.num_blocks
            if evict:
                num_cached, num_evictions = cache.num_cached_blocks, self.num_evictions
                assert cache.evict(self.kv.num_blocks) == num_cached
                self.num_evictions = num_evictions  # not the workload's eviction
                assert cache.num_cached_blocks == cache.num_unlocked_blocks == 0
        if cache is None or evict:
            assert self.kv.pool.num_free == self.kv.num_blocks, "KV blocks leaked"
        self.kv.check_invariants()
        for rid, r in self.members.items():
            assert r.is_finished, f"{rid} never finished"
            assert r.block_ids == []
            n = self.finished_reported[rid]
            assert n == self.id_uses[rid], f"{rid} reported finished {n} times"
        assert set(self.finished_reported) == set(self.members)
        assert self.num_thrash == self.sched.protected_victims


def outputs(h: Harness) -> dict[str, list[int]]:
    return {rid: r.output_token_ids for rid, r in h.members.items()}


def expected_outputs(h: Harness) -> dict[str, list[int]]:
    return {
        rid: reference_output(
            r.prompt_token_ids, r.sampling, r.max_tokens, r.eos_token_ids, r.sample_index, h.max_model_len
        )[0]
        for rid, r in h.members.items()
    }


# -- random workloads ------------------------------------------------------


@dataclass(frozen=True)
class GroupSpec:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    mode: str  # "ignore_eos", "eos" or "stop_token"
    stop: int
    min_tokens: int
    arrival: int
    cache_salt: str | None = None
    priority: int = 0
    tenant: str | None = None

    def build(self, arrival_time: float = 0.0) -> tuple[Request, list[Request]]:
        return make_group(
            self.rid,
            list(self.prompt),
            self.max_tokens,
            self.n,
            ignore_eos=self.mode != "eos",
            eos=(self.stop,),
            stop_token_ids=[self.stop] if self.mode == "stop_token" else None,
            min_tokens=self.min_tokens,
            cache_salt=self.cache_salt,
            priority=self.priority,
            tenant=self.tenant,
            arrival_time=arrival_time,
        )

    def member_ids(self) -> list[str]:
        return [self.rid] + [f"{self.rid}#{i}" for i in range(1, self.n)]


@dataclass(frozen=True)
class Workload:
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    groups: tuple[GroupSpec, ...]
    extra_blocks: int
    aborts: tuple[tuple[int, int], ...]  # (step, index into all member ids)
    max_model_len: int = 64

    def blocks_needed(self, g: GroupSpec) -> int:
        return -(-(len(g.prompt) + g.max_tokens) // self.block_size)

    @property
    def tight_blocks(self) -> int:
        """The fewest blocks check_fits accepts for every request: preemption is likely."""
        return max(self.blocks_needed(g) for g in self.groups) + self.extra_blocks

    @property
    def ample_blocks(self) -> int:
        """Enough blocks for every sample of every request at full length at once: no preemption.

        With prefix caching, also enough to keep everything ever computed cached: no eviction.
        """
        return sum(g.n * self.blocks_needed(g) for g in self.groups)

    def all_ids(self) -> list[str]:
        return [rid for g in self.groups for rid in g.member_ids()]

    def work(self) -> int:
        return sum(g.n * (len(g.prompt) + g.max_tokens) for g in self.groups)


def run_workload(
    w: Workload, num_blocks: int, aborts: tuple[tuple[int, int], ...], **harness_kwargs
) -> Harness:
    h = Harness(
        num_blocks, w.block_size, w.max_num_seqs, w.max_num_batched_tokens, w.max_model_len, **harness_kwargs
    )
    ids = w.all_ids()
    last_arrival = max(g.arrival for g in w.groups)
    # Generous: every token could be recomputed after a preemption, one token per step.
    max_steps = 50 + last_arrival + 4 * w.work() * (1 + max(g.max_tokens for g in w.groups))
    step = 0
    while True:
        for g in w.groups:
            if g.arrival == step:
                h.add(*g.build(arrival_time=float(step)))
        if step > last_arrival and not h.sched.has_unfinished():
            break
        assert step < max_steps, "no progress: the scheduler is livelocked"
        h.step()
        for at, k in aborts:
            if at == step:
                h.finish([ids[k % len(ids)]])  # may be unknown (not yet arrived) or finished: ignored
        step += 1
    h.check_end(evict=True)
    return h
