"""A fake model runner and one checking harness for every scheduler test (no torch, no model).

The fake runner keeps a simulated paged KV cache: each slot holds the (position, token) written
there and a hash of the whole sequence that token was computed under. It performs the step's
copy-on-write copies, writes every scheduled token (drafts too) through the request's block table
(refusing to write into a block that another request or the prefix cache still holds), and, for a
request that has caught up, reads its whole sequence back through the block table, verifies its
drafts and samples a token that depends only on that history. A paging, copy-on-write, recompute,
prefix-cache or rewind bug therefore shows up as a runner assertion or as tokens that differ from
a reference computed without any scheduler.

Speculation (`Harness(mode=...)`): a SpecHook (by default `RandomDrafts`, a random draft length per
decoding request) either proposes the drafts itself (mode "scheduler", as n-gram lookup does,
possibly fewer than asked) or leaves them to the runner (mode "runner", as a draft model does). The
runner verifies them against a deterministic target (the drafts that match the target's own tokens
are accepted, so outputs equal those of the run without speculation) or, with
`deterministic=False`, accepts a random prefix and samples a random token (only the invariants hold).

`Harness` drives a scheduler step by step and checks, after every step: the queues; the block
accounting (refcount = holders in live block tables + 1 if the prefix cache owns the block); the
prefix-cache tree (locks, ownership, every cached block holding exactly the verified tokens of its
path, computed under that path, also checked whenever `cache_computed` runs); the step's plan (token
budget with drafts counted, seats, blocks covering the computed plus scheduled tokens, block tables
only growing while a request runs, drafts only on decoding requests and only as many as planned);
`update` rewinding over rejected drafts without freeing a block; and, through the scheduler's
`on_preempt` hook, every victim choice against the documented victim rules (drafts never make a
request wait for blocks or preempt another). At the end every block is released.

Swap (`Harness(num_swap_blocks=..., preemption=...)`): the fake runner keeps a host store beside the
device one and performs the step's swap-outs, copy-on-write copies and swap-ins in the runner's
order, poisoning a device block it copied out once nobody holds it and a host block once copied
back in, so a swapped-in request that reads anything but its own KV fails its reads. The state check
counts swapped requests' kept device blocks and host blocks: every host block has one owner.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.policy import PRIORITY, SchedulingConfig
from tandem.core.preemption import PreemptionCost
from tandem.core.prefix_cache import Node
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Preemption, Scheduler, SpecHook
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.sampling_params import SamplingParams

VOCAB = 29

# A "model": the next token of a sample, from its history and its index in the group.
Target = Callable[[list[int], int], int]


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
    target: Target = next_token,
) -> tuple[list[int], RequestStatus]:
    """What one sample must produce, computed without a scheduler or KV cache."""
    toks = list(prompt)
    out: list[int] = []
    while True:
        t = target(toks, index)
        toks.append(t)
        out.append(t)
        # min_tokens is the sampler's (it holds stop tokens back): a stop token the model gives stops.
        if not sp.ignore_eos and t in eos:
            return out, RequestStatus.FINISHED_STOPPED
        if t in sp.stop_token_ids:
            return out, RequestStatus.FINISHED_STOPPED
        if len(out) >= max_tokens or len(toks) >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH


def reference(req: Request, max_model_len: int, target: Target = next_token) -> list[int]:
    """The tokens `req` must produce (`reference_output` for a request as built)."""
    return reference_output(
        req.prompt_token_ids,
        req.sampling,
        req.max_tokens,
        req.eos_token_ids,
        req.sample_index,
        max_model_len,
        target,
    )[0]


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


def kv_contexts(seq: list[int]) -> list[int]:
    """What the KV at each position depends on: the whole sequence up to and including it (a hash
    chain, so a slot written under one sequence never passes for another's)."""
    out = []
    h = 0
    for t in seq:
        h = hash((h, t))
        out.append(h)
    return out


# -- speculation -----------------------------------------------------------


def continuation(target: Target, seq: list[int], index: int, k: int) -> list[int]:
    """The target's own next k tokens after `seq`."""
    seq = list(seq)
    out = []
    for _ in range(k):
        out.append(target(seq, index))
        seq.append(out[-1])
    return out


def guess(target: Target, req: Request, k: int, rng: random.Random) -> list[int]:
    """k draft tokens: the target's continuation up to a random point, random tokens from there."""
    good = continuation(target, req.token_ids, req.sample_index, k)
    wrong_from = rng.randint(0, k)
    out = good[:wrong_from]
    if wrong_from < k:
        out.append((good[wrong_from] + rng.randint(1, VOCAB - 1)) % VOCAB)  # surely rejected
        out += [rng.randrange(VOCAB) for _ in range(k - wrong_from - 1)]
    return out


def room(req: Request, max_model_len: int) -> int:
    """The most drafts `req` may keep: within max_tokens (after the bonus token) and max_model_len."""
    return min(req.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens)


@dataclass(frozen=True)
class DraftPlan:
    """A step's speculation plan (core.step_io.SpecPlan) as the fake hooks make it."""

    num_draft: dict[str, int]


class RandomDrafts:
    """A SpecHook: a random draft length per decoding request; proposes the drafts itself in mode
    "scheduler" (possibly fewer than asked, even none), leaves them to the runner in mode "runner"."""

    def __init__(self, mode: str, max_k: int, rng: random.Random, target: Target) -> None:
        self.mode = mode
        self.max_k = max_k
        self.rng = rng
        self.target = target

    def leased(self, running: list[Request]) -> DraftPlan | None:
        return None

    def plan(self, decoding: list[Request], other_tokens: int, max_model_len: int) -> DraftPlan:
        ks = {}
        for r in decoding:
            k = min(self.rng.randint(0, self.max_k), room(r, max_model_len))
            if k > 0:
                ks[r.request_id] = k
        return DraftPlan(ks)

    def propose(self, req: Request, k: int) -> list[int] | None:
        if self.mode == "runner":
            return None
        return guess(self.target, req, self.rng.randint(0, k), self.rng)

    def observe(self, req: Request, num_draft: int, num_accepted: int) -> None:
        pass


# -- the fake runner -------------------------------------------------------


class FakeRunner:
    """Writes every scheduled token (drafts too) through the block tables and verifies the drafts.

    `deterministic`: drafts are accepted while they equal the target's tokens, then the target's next
    token is sampled (so speculation changes nothing). Otherwise a random prefix of the drafts is
    accepted and the sampled token is random.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        target: Target = next_token,
        rng: random.Random | None = None,
        deterministic: bool = True,
    ) -> None:
        self.kv = kv
        self.target = target
        self.rng = rng or random.Random(0)
        self.deterministic = deterministic
        # How the runner makes drafts when the scheduler asks for them without proposing (draft model).
        self.make_drafts = lambda req, k: guess(self.target, req, k, self.rng)
        self.store: list[list[tuple[int, int, int] | None]] = [
            [None] * kv.block_size for _ in range(kv.num_blocks)
        ]
        self.host_store: list[list[tuple[int, int, int] | None]] = [
            [None] * kv.block_size for _ in range(kv.num_swap_blocks)
        ]
        self.active: dict[str, Request] = {}  # per-request state a real runner would keep
        self.num_copies = 0
        self.num_swapped_out = self.num_swapped_in = 0

    def slot(self, req: Request, pos: int) -> tuple[int, int]:
        bs = self.kv.block_size
        return req.block_ids[pos // bs], pos % bs

    def check_read(self, req: Request, seq: list[int]) -> None:
        """The KV of every position of `seq`, read through the block table, is that of `seq`."""
        for pos, c in enumerate(kv_contexts(seq)):
            b, j = self.slot(req, pos)
            assert self.store[b][j] == (pos, seq[pos], c), (
                f"{req.request_id}: KV at position {pos} is {self.store[b][j]}, not that of its sequence"
            )

    def sample(self, seq: list[int], index: int) -> int:
        return self.target(seq, index) if self.deterministic else self.rng.randrange(VOCAB)

    def execute(self, sched: SchedulerOutput, proposed: dict[str, list[int]] | None = None) -> RunnerOutput:
        """`proposed`: the hook's proposals this step when the scheduler proposes; None when the runner does."""
        pool = self.kv.pool
        bs = self.kv.block_size
        for rid in sched.finished_ids:
            self.active.pop(rid, None)
        swap_pool = self.kv.swap_pool
        back_in = {h for h, _ in sched.swap_in}  # a victim of this step may come back in it too
        assert len({h for _, h in sched.swap_out}) == len(sched.swap_out), "two swap-outs into one host block"
        for dev, host in sched.swap_out:  # first: their device blocks may be reused in this step
            assert swap_pool is not None, "a swap-out without a swap space"
            assert swap_pool.refcount(host) == 1 or host in back_in, "swap-out into a free host block"
            assert any(slot is not None for slot in self.store[dev]), "swap-out of a block never written"
            self.host_store[host] = list(self.store[dev])
            self.num_swapped_out += 1
        for dev, _ in sched.swap_out:
            if pool.refcount(dev) == 0:
                self.store[dev] = [None] * bs  # nobody holds it: whoever reads it now is wrong
        for src, dst in sched.block_copies:
            assert pool.refcount(dst) == 1, "copy into a block that is free or shared"
            self.store[dst] = list(self.store[src])
            self.num_copies += 1
        for host, dev in sched.swap_in:
            assert swap_pool is not None and swap_pool.refcount(host) == 0, "a swapped-in host block kept"
            assert pool.refcount(dev) == 1, "swap-in into a block that is free or shared"
            assert any(slot is not None for slot in self.host_store[host]), (
                "swap-in of a host block never written"
            )
            self.store[dev] = list(self.host_store[host])
            self.host_store[host] = [None] * bs
            self.num_swapped_in += 1
        out = RunnerOutput()
        for req, n in zip(sched.requests, sched.num_tokens):
            rid = req.request_id
            assert not req.is_finished, f"finished request {rid} scheduled"
            prev = self.active.setdefault(rid, req)
            assert prev is req, f"{rid} reused before the runner was told the old one finished"
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
            contexts = kv_contexts(seq)
            assert len(req.block_ids) * bs >= start + n
            for pos in range(start, start + n):
                b, j = self.slot(req, pos)
                # Refcount 1: neither another request nor the prefix cache holds the block being written.
                assert pool.refcount(b) == 1, f"{rid} writes into shared block {b}"
                self.store[b][j] = (pos, seq[pos], contexts[pos])
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
    """Checks, whenever blocks may go into the prefix cache, that they hold only verified tokens' KV;
    records swaps, and checks that a request is swapped back in with the tokens it had computed."""

    runner: FakeRunner
    swapped_computed: dict[str, int]
    swapped_in: list[Request]

    def cache_computed(self, req: Request) -> None:
        assert req.num_computed_tokens <= req.num_tokens, "computed past the known tokens"
        full = req.num_computed_tokens // self.block_size * self.block_size
        self.runner.check_read(req, req.token_ids[:full])
        super().cache_computed(req)

    def swap_out(self, req: Request, copies: list[tuple[int, int]]) -> bool:
        # Everything it computed is read back intact first: what goes to host memory is its own KV.
        self.runner.check_read(req, req.token_ids[: req.num_computed_tokens])
        if not super().swap_out(req, copies):
            return False
        self.swapped_computed[req.request_id] = req.num_computed_tokens
        return True

    def swap_in(
        self,
        req: Request,
        num_new_tokens: int,
        copies: list[tuple[int, int]],
        swap_copies: list[tuple[int, int]],
    ) -> bool:
        computed, table, host = req.num_computed_tokens, list(req.block_ids), list(req.host_block_ids)
        if not super().swap_in(req, num_new_tokens, copies, swap_copies):
            assert (req.num_computed_tokens, req.block_ids, req.host_block_ids) == (computed, table, host), (
                "a failed swap-in changed the request"
            )
            return False
        assert self.swapped_computed.pop(req.request_id) == req.num_computed_tokens == computed
        self.swapped_in.append(req)
        return True

    def free(self, req: Request, cache: bool = True) -> None:
        self.swapped_computed.pop(req.request_id, None)  # a swapped request may end without coming back
        super().free(req, cache)


def fits(kv: KVCacheManager, req: Request, n: int) -> bool:
    """Whether `allocate_slots(req, n)` can succeed now (new blocks plus copies of shared ones)."""
    start, end, table = req.num_computed_tokens, req.num_computed_tokens + n, req.block_ids
    last = min(len(table), kv.blocks_for(end))
    shared = sum(kv.pool.refcount(table[i]) > 1 for i in range(start // kv.block_size, last))
    return max(0, kv.blocks_for(end) - len(table)) + shared <= kv.num_available


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


# -- the harness -------------------------------------------------------------


Arrivals = dict[int, list[tuple[Request, list[Request]]]]


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
    keep_outputs: bool = False
    # Speculation: None (off), "scheduler" (the hook proposes) or "runner" (the runner drafts).
    mode: str | None = None
    max_k: int = 4  # RandomDrafts' longest draft
    deterministic: bool = True
    seed: int = 0
    target: Target = next_token
    spec: SpecHook | None = None  # a SpecHook to use instead of RandomDrafts
    # Swap: host blocks of swap space, and the cost model choosing swap or recompute (None: recompute).
    num_swap_blocks: int = 0
    preemption: PreemptionCost | None = None
    kv: CheckedKV = field(init=False)
    sched: Scheduler = field(init=False)
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
    # Victim choices (seen through Scheduler.on_preempt): protected victims, protected requests left
    # waiting for blocks, and (victim, the request it made room for) under the priority policy.
    protected_victims: int = 0
    stalls: int = 0
    priority_victims: list[tuple[Request, Request]] = field(default_factory=list)
    # Prefix caching: every block-aligned prefix computed so far, per cache salt (what an ideal cache that
    # never evicts would hold), and for every admission (request id, tokens matched, ideal match).
    computed_prefixes: dict[str | None, set[tuple[int, ...]]] = field(default_factory=dict)
    admissions: list[tuple[str, int, int]] = field(default_factory=list)
    num_evictions: int = 0
    # Speculation counters.
    num_drafted: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_rewound: int = 0  # verifies that rejected at least one draft
    num_extra_blocks: int = 0  # steps ending with a request holding blocks past what it computed
    # Per sample, the tokens each step handed out as new (as the engine core's outputs take them).
    delivered: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.kv = CheckedKV(
            self.num_blocks, self.block_size, self.enable_prefix_caching, self.num_swap_blocks
        )
        if self.spec is None and self.mode is not None:
            self.spec = RandomDrafts(self.mode, self.max_k, random.Random(rng.random()), self.target)
        kwargs = {} if self.clock is None else {"clock": self.clock}
        self.sched = Scheduler(
            self.kv,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            config=self.config,
            spec=self.spec,
            on_preempt=self.check_preemption,
            preemption=self.preemption,
            **kwargs,
        )
        self.runner = FakeRunner(self.kv, self.target, random.Random(rng.random()), self.deterministic)
        self.kv.runner = self.runner
        self.kv.swapped_computed, self.kv.swapped_in = {}, []
        self.planned: dict[str, int] = {}
        self.proposed: dict[str, list[int]] = {}
        self.observed: list[tuple[str, int, int]] = []
        if self.spec is not None:
            self._record(self.spec)
        if self.kv.cache is not None:
            cache = self.kv.cache
            evict = cache.evict

            def counting_evict(num_blocks: int) -> int:
                freed = evict(num_blocks)
                self.num_evictions += freed
                return freed

            cache.evict = counting_evict  # type: ignore[method-assign]

    def _record(self, spec: SpecHook) -> None:
        """Wrap the hook to record (and check) what the scheduler asks of it and tells it."""
        plan, propose, observe = spec.plan, spec.propose, spec.observe

        def recorded_plan(decoding: list[Request], other_tokens: int, max_model_len: int):
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

        spec.plan, spec.propose, spec.observe = recorded_plan, recorded_propose, recorded_observe  # type: ignore[method-assign]

    def check_preemption(self, p: Preemption) -> None:
        """Every victim choice against the documented rules (Scheduler.on_preempt), with its outcome counted."""
        sched, victim = self.sched, p.victim
        if p.for_priority:
            assert victim is not None and sched.config.policy == PRIORITY
            assert any(victim is r for r in sched.running)
            assert victim.priority > p.request.priority, "preempted a request of equal or higher priority"
            assert not victim.protected, "preempted a protected request for priority"
            self.priority_victims.append((victim, p.request))
            return
        i = next(j for j, r in enumerate(sched.running) if r is p.request)
        req = p.request
        if req.num_tokens - req.num_computed_tokens == 1:
            # Drafts are optional: a request never waits for blocks, nor takes them from another, for them.
            assert not fits(self.kv, req, 1), (
                f"{req.request_id} asks for a victim although its next token alone fits: for its drafts"
            )
        # running[:i] were scheduled this step already: they are never victims.
        assert victim is None or any(victim is r for r in sched.running[i:])
        unprotected = [r for r in sched.running[i + 1 :] if not r.protected]
        if unprotected:
            assert victim is unprotected[-1], "the victim must be the latest unprotected request"
        elif not req.protected:
            assert victim is req, "with every later request protected, the asking request gives way"
        elif i > 0:
            assert victim is None, "a protected request must wait rather than be preempted"
            self.stalls += 1
        else:
            assert victim is sched.running[-1]
        if victim is not None and victim.protected:
            # Unavoidable only when every running request is protected and the first cannot go on.
            assert all(r.protected for r in sched.running)
            self.protected_victims += 1

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

    # -- invariants ------------------------------------------------------

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
        swapped = [r for r in waiting if r.status == RequestStatus.SWAPPED]
        # Every reference to a block is held by exactly one live request's block table (a swapped
        # request's kept blocks too), or by the cache.
        holders = Counter(b for r in running + swapped for b in r.block_ids)
        owned = self.check_tree(holders) if kv.cache is not None else set()
        for b in range(pool.num_blocks):
            assert pool.refcount(b) == holders[b] + (b in owned), (
                f"block {b}: refcount {pool.refcount(b)}, {holders[b]} holders, cached: {b in owned}"
            )
        # Conservation: free + cached only + held by requests == all blocks.
        assert pool.num_free + len(owned - set(holders)) + len(holders) == pool.num_blocks
        # Every host block in use has exactly one owner, a swapped request; none leaks.
        host_holders = Counter(h for r in swapped for h in r.host_block_ids)
        assert all(c == 1 for c in host_holders.values()), "a host block owned twice"
        if kv.swap_pool is None:
            assert not host_holders
        else:
            for h in range(kv.swap_pool.num_blocks):
                assert kv.swap_pool.refcount(h) == host_holders[h], f"host block {h} leaked or double-owned"
        assert sum(r.num_seats for r in running) <= sched.max_num_seqs
        # A step admits only after serving every running request in full (each then samples), and
        # only the last request it admits can be left partly computed: so at most one running request
        # is ever protected, and a protected request never has to preempt another protected one.
        assert sum(r.protected for r in running) <= 1
        for r in running:
            assert r.status == RequestStatus.RUNNING
            assert len(set(r.block_ids)) == len(r.block_ids)
            assert 0 < r.num_computed_tokens < r.num_tokens, "a running request with nothing to do"
            if self.spec is None:
                assert len(r.block_ids) == kv.blocks_for(r.num_computed_tokens)
            else:
                # Rejected drafts leave their blocks allocated (reused by the next step), but drafts are
                # capped by max_tokens: never more blocks than the request could ever need.
                assert len(r.block_ids) >= kv.blocks_for(r.num_computed_tokens)
                assert len(r.block_ids) <= kv.blocks_for(r.num_prompt_tokens + r.max_tokens)
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
            if r.status == RequestStatus.SWAPPED:
                # Its computed KV is kept whole: leading device blocks shared with others, the rest on host.
                assert 0 < r.num_computed_tokens < r.num_tokens and r.num_preemptions > 0
                assert len(r.block_ids) + len(r.host_block_ids) == kv.blocks_for(r.num_computed_tokens)
                continue
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.prefix_node is None
            assert not r.host_block_ids
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
        owned: set[int] = set()
        unlocked: set[int] = set()
        expected_lock: Counter = Counter()
        holding = self.sched.running + [r for r in self.sched.waiting if r.status == RequestStatus.SWAPPED]
        for r in holding:
            node = r.prefix_node
            assert isinstance(node, Node), f"running {r.request_id} has no prefix-cache node"
            assert node.end % bs == 0 and node.end <= r.num_computed_tokens
            # A swapped request locks only the path its kept device blocks lie on.
            assert node.end <= len(r.block_ids) * bs
            assert path_tokens(node) == r.token_ids[: node.end], f"{r.request_id} locks a foreign path"
            # It reads the cached blocks of the path it locks (no private duplicate of cached KV).
            assert r.block_ids[: node.end // bs] == path_blocks(node), f"{r.request_id} duplicates cached KV"
            top = node
            while top.parent is not None:
                expected_lock[id(top)] += 1
                top = top.parent
            assert top is cache.roots[r.cache_salt], f"{r.request_id} locks a node of another salt's tree"
        for n, _ in tree_nodes(kv):
            assert n.lock == expected_lock[id(n)], "a node's lock count is not the number of requests under it"
            owned.update(n.blocks)
            if n.lock == 0:
                unlocked.update(n.blocks)
            # A cached block holds the KV of the verified tokens on its path, computed under that path
            # (never a draft), and is never overwritten.
            path = path_tokens(n)
            contexts = kv_contexts(path)
            start = n.end - len(n.key)
            for i, b in enumerate(n.blocks):
                for j in range(bs):
                    pos = start + i * bs + j
                    assert self.runner.store[b][j] == (pos, path[pos], contexts[pos]), (
                        f"cached block {b} does not hold the KV of its path at position {pos}"
                    )
        assert len(owned) == cache.num_cached_blocks and len(unlocked) == cache.num_unlocked_blocks
        for r in holding:
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

    # -- one step --------------------------------------------------------

    def step(self) -> SchedulerOutput:
        sched = self.sched
        before_running = [id(r) for r in sched.running]
        tables_before = {id(r): list(r.block_ids) for r in sched.running}
        stalls_before = self.stalls
        priority_before = len(self.priority_victims)
        unprotected_before = [r for r in sched.running if not r.protected]
        had_work = sched.has_unfinished()
        out = sched.schedule()
        self.num_steps += 1
        if self.keep_outputs:
            self.outputs.append(out)
        if had_work:
            assert not out.is_empty, "requests are pending but the step does nothing"
        self._check_plan(out, tables_before)
        self._check_preempted(out, before_running, stalls_before, priority_before, unprotected_before)
        self._count_admissions(out, before_running)
        # -- the model
        proposed = self.proposed if self.mode == "scheduler" else None
        starts = {r.request_id: r.num_computed_tokens for r in out.requests}
        lengths = {r.request_id: r.num_tokens for r in out.requests}
        result = self.runner.execute(out, proposed)
        if not out.is_empty:
            tables = {r.request_id: list(r.block_ids) for r in out.requests}
            observed = len(self.observed)
            changed = sched.update(out, result)
            assert len({id(r) for r in changed}) == len(changed)
            for r in changed:
                self.resumed_unsampled.discard(r.request_id)
                assert r.num_output_tokens >= 1
                start = lengths.get(r.request_id, r.num_prompt_tokens)  # a forked child: from its prompt
                self.delivered.setdefault(r.request_id, []).extend(r.token_ids[start:])
            self._check_update(out, result, starts, lengths, tables, observed)
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

    def _check_plan(self, out: SchedulerOutput, tables_before: dict[int, list[int]]) -> None:
        """The step's plan: budget with drafts, seats, block coverage, drafts only where planned."""
        sched, kv, bs = self.sched, self.kv, self.block_size
        assert len(out.requests) == len(out.num_tokens)
        assert len({id(r) for r in out.requests}) == len(out.requests), "a request scheduled twice"
        assert out.total_tokens <= sched.max_num_batched_tokens, "the step overran the token budget"
        assert sum(r.num_seats for r in sched.running) <= sched.max_num_seqs
        scheduled = {r.request_id for r in out.requests}
        assert set(out.num_draft) <= scheduled and set(out.draft_tokens) <= set(out.num_draft)
        if self.spec is None:
            assert not out.num_draft and not out.draft_tokens
        planned = self.planned if self.spec is not None else {}
        proposed = self.proposed if self.mode == "scheduler" else None
        copies = set(out.block_copies)
        for v in out.preempted:  # a victim of the priority policy may be readmitted in the same step
            tables_before.pop(id(v), None)
        for r, n in zip(out.requests, out.num_tokens):
            assert any(r is x for x in sched.running)
            assert r.status == RequestStatus.RUNNING
            owed = r.num_tokens - r.num_computed_tokens
            k = out.num_draft.get(r.request_id, 0)
            assert n >= 1 and k >= 0
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
            before = tables_before.get(id(r))
            assert len(r.block_ids) == max(kv.blocks_for(r.num_computed_tokens + n), len(before or ()))
            if before is not None:
                # Running since the last step: the table only grew, or a block was copied on write.
                assert len(r.block_ids) >= len(before), "a block table shrank while running"
                for i, b in enumerate(before):
                    if r.block_ids[i] != b:
                        assert (b, r.block_ids[i]) in copies, "a block was swapped without a copy"

    def _check_preempted(
        self,
        out: SchedulerOutput,
        before_running: list[int],
        stalls_before: int,
        priority_before: int,
        unprotected_before: list[Request],
    ) -> None:
        """Preemptions and requests left waiting for blocks, against the victim rules."""
        sched = self.sched
        scheduled_ids = {id(r) for r in out.requests}
        preempted_ids = {id(r) for r in out.preempted}
        num_priority = len(self.priority_victims) - priority_before
        assert [v for v, _ in self.priority_victims[priority_before:]] == out.preempted[:num_priority]
        left_waiting = [r for r in sched.running if id(r) not in scheduled_ids]
        if out.total_tokens < sched.max_num_batched_tokens:
            # Not for lack of budget: such a request waits for blocks, which only a protected one may do.
            assert all(r.protected for r in left_waiting), "an unprotected request was skipped"
        if len(out.preempted) > num_priority or self.stalls > stalls_before:
            # Blocks are short: new requests would only take them from those already running.
            assert all(id(r) in before_running for r in out.requests), (
                "admitted a request while short of blocks"
            )
        if any(v.request_id in self.resumed_unsampled for v in out.preempted):
            # A resumed request lost its progress again: only when no unprotected request could give way.
            assert all(id(r) in preempted_ids for r in unprotected_before)
        made_room_for = {id(v): c for v, c in self.priority_victims[priority_before:]}
        for v in out.preempted:
            if any(v is r for r in sched.running):
                # Readmitted at once: only a priority victim, with the room left once the request it made
                # room for was admitted (preemption frees a whole request, which may be more than needed).
                cand = made_room_for[id(v)]
                pos = [id(r) for r in out.requests]
                assert id(cand) in pos and pos.index(id(cand)) < pos.index(id(v)), "a pointless preemption"
                assert v.status == RequestStatus.RUNNING
            elif v.status == RequestStatus.SWAPPED:
                assert v.request_id in self.kv.swapped_computed, "swapped without swap_out"
                assert any(v is w for w in sched.waiting)
            else:
                assert (
                    v.status == RequestStatus.PREEMPTED and v.block_ids == [] and v.num_computed_tokens == 0
                ), "a preempted request kept its blocks"
                assert any(v is w for w in sched.waiting)
            assert v.protected
            if v.request_id in self.resumed_unsampled:
                self.num_thrash += 1
            self.resumed_unsampled.add(v.request_id)
        for rid in out.finished_ids:
            self.finished_reported[rid] += 1

    def _count_admissions(self, out: SchedulerOutput, before_running: list[int]) -> None:
        """Chunked and mixed steps; for each admission, the cached tokens against an ideal cache's."""
        is_prefill = [
            r.num_computed_tokens + n < r.num_prompt_tokens for r, n in zip(out.requests, out.num_tokens)
        ]
        is_decode = [r.num_computed_tokens >= r.num_prompt_tokens for r in out.requests]
        if any(is_prefill):
            self.num_chunked += 1
            if any(is_decode):
                self.num_mixed += 1
        preempted_ids = {id(r) for r in out.preempted}
        swapped_in = {id(r) for r in self.kv.swapped_in}
        self.kv.swapped_in = []
        for r in out.requests:
            if id(r) in swapped_in:
                continue  # resumed with its own KV, nothing from the cache (checked in CheckedKV.swap_in)
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

    def _check_update(
        self,
        out: SchedulerOutput,
        result: RunnerOutput,
        starts: dict[str, int],
        lengths: dict[str, int],
        tables: dict[str, list[int]],
        observed: int,
    ) -> None:
        """`update` keeps accepted drafts, rewinds over rejected ones, and never frees a block."""
        kv, bs = self.kv, self.block_size
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

    # -- whole runs ------------------------------------------------------

    def finish(self, rids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.sched.finish_requests(rids, status)
        self.check_state()

    def drain(self, max_steps: int) -> None:
        while self.sched.has_unfinished():
            assert self.num_steps < max_steps, "no progress: the scheduler is livelocked"
            self.step()
        self.check_end()

    def run(self, arrivals: Arrivals, aborts: tuple[tuple[int, int], ...] = (), max_steps: int = 2000) -> None:
        """Add each group at its step, abort (step, index into all member ids) after that step, run
        until everything finished; then check the end state, the cache emptied."""
        ids = [m.request_id for groups in arrivals.values() for _, ms in groups for m in ms]
        last = max(arrivals, default=0)
        step = 0
        while True:
            for leader, members in arrivals.get(step, []):
                self.add(leader, members)
            if step > last and not self.sched.has_unfinished():
                break
            assert step < max_steps, "no progress: the scheduler is livelocked"
            self.step()
            for at, k in aborts:
                if at == step:
                    self.finish([ids[k % len(ids)]])  # may be unknown (not yet arrived) or finished: ignored
            step += 1
        self.check_end(evict=True)

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
                assert cache.roots == {}, "an emptied salt's root was kept"
        if cache is None or evict:
            assert self.kv.pool.num_free == self.kv.num_blocks, "KV blocks leaked"
        self.kv.check_invariants()
        for rid, r in self.members.items():
            assert r.is_finished, f"{rid} never finished"
            assert r.block_ids == [] and r.host_block_ids == []
            if self.id_uses[rid] == 1:
                # Every output token was handed out exactly once, in order.
                assert self.delivered.get(rid, []) == r.output_token_ids, f"{rid} delivered other tokens"
            n = self.finished_reported[rid]
            assert n == self.id_uses[rid], f"{rid} reported finished {n} times"
        assert set(self.finished_reported) == set(self.members)
        assert self.num_thrash == self.protected_victims
        if self.kv.swap_pool is not None:
            assert self.kv.swap_pool.num_free == self.kv.num_swap_blocks, "host blocks leaked"
        assert not self.kv.swapped_computed, "a swapped-out request never came back nor finished"


def outputs(h: Harness) -> dict[str, list[int]]:
    return {rid: r.output_token_ids for rid, r in h.members.items()}


def expected_outputs(h: Harness) -> dict[str, list[int]]:
    return {rid: reference(r, h.max_model_len, h.target) for rid, r in h.members.items()}


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

    def build(self, arrival_time: float | None = None) -> tuple[Request, list[Request]]:
        """Its requests; `arrival_time` defaults to the arrival step."""
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
            arrival_time=float(self.arrival) if arrival_time is None else arrival_time,
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

    def arrivals(self) -> Arrivals:
        out: Arrivals = {}
        for g in self.groups:
            out.setdefault(g.arrival, []).append(g.build())
        return out

    def work(self) -> int:
        return sum(g.n * (len(g.prompt) + g.max_tokens) for g in self.groups)

    def max_steps(self) -> int:
        """Generous: every token could be recomputed after a preemption, one token per step."""
        last_arrival = max(g.arrival for g in self.groups)
        return 50 + last_arrival + 4 * self.work() * (1 + max(g.max_tokens for g in self.groups))


def run_workload(
    w: Workload, num_blocks: int, aborts: tuple[tuple[int, int], ...], **harness_kwargs
) -> Harness:
    h = Harness(
        num_blocks, w.block_size, w.max_num_seqs, w.max_num_batched_tokens, w.max_model_len, **harness_kwargs
    )
    h.run(w.arrivals(), aborts, w.max_steps())
    return h
