"""BlockPool and KVCacheManager: reference counting, leaks, double frees, fork and copy-on-write.

Pure Python, no torch: the KV contents are simulated by a dict of block -> slots so that
copy-on-write and block-table bookkeeping can be checked for what a model would actually read.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from tandem.core.block_pool import BlockPool
from tandem.core.kv_cache_manager import KVCacheManager, cdiv
from tandem.core.request import Request
from tandem.sampling_params import SamplingParams

_ids = itertools.count()


def make_req(prompt_len: int = 1, rid: str | None = None) -> Request:
    rid = rid if rid is not None else f"r{next(_ids)}"
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=8), max_tokens=8)


def pool_state(pool: BlockPool) -> tuple[list[int], list[int]]:
    return list(pool._free), list(pool._refcount)


def holders_count(pool: BlockPool, reqs: list[Request]) -> list[int]:
    counts = [0] * pool.num_blocks
    for r in reqs:
        for b in r.block_ids:
            counts[b] += 1
    return counts


def check_accounting(pool: BlockPool, reqs: list[Request]) -> None:
    """Free list and refcounts agree, every reference is held by a live request, nothing is lost."""
    pool.check_invariants()
    counts = holders_count(pool, reqs)
    assert [pool.refcount(b) for b in range(pool.num_blocks)] == counts
    used = {b for r in reqs for b in r.block_ids}
    assert pool.num_free + len(used) == pool.num_blocks
    assert pool.num_used == len(used)
    for r in reqs:
        assert len(set(r.block_ids)) == len(r.block_ids), "a block appears twice in one block table"


# -- BlockPool -----------------------------------------------------------


def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(-3)


def test_pool_starts_free() -> None:
    pool = BlockPool(5)
    assert pool.num_free == 5
    assert pool.num_used == 0
    assert pool.usage == 0.0
    assert all(pool.refcount(b) == 0 for b in range(5))
    pool.check_invariants()


def test_allocate_distinct_and_refcount_one() -> None:
    pool = BlockPool(6)
    a = pool.allocate(4)
    assert len(a) == len(set(a)) == 4
    assert all(0 <= b < 6 for b in a)
    assert all(pool.refcount(b) == 1 for b in a)
    assert pool.num_free == 2
    assert pool.usage == pytest.approx(4 / 6)
    b = pool.allocate(2)
    assert not set(a) & set(b)
    assert pool.num_free == 0
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_allocate_too_many_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool_state(pool)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool_state(pool) == before
    pool.check_invariants()


def test_incref_and_free_release_on_last_reference() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.incref([b])
    assert pool.refcount(b) == 3
    pool.free([b])
    pool.free([b])
    assert pool.refcount(b) == 1
    assert pool.num_free == 2
    pool.check_invariants()
    pool.free([b])
    assert pool.refcount(b) == 0
    assert pool.num_free == 3
    pool.check_invariants()


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    pool.check_invariants()
    # Never-allocated blocks cannot be freed either.
    free_block = next(x for x in range(3) if x not in (a, b))
    with pytest.raises(RuntimeError):
        pool.free([free_block])
    pool.check_invariants()
    # A list dropping the same single reference twice is a double free too.
    with pytest.raises(RuntimeError):
        pool.free([b, b])
    pool.check_invariants()
    assert pool.num_free == 3


def test_incref_free_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.incref([0])
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.incref([b])
    pool.check_invariants()
    assert pool.num_free == 2


def test_freed_blocks_are_reused() -> None:
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.free(a)
    b = pool.allocate(2)
    assert sorted(a) == sorted(b)
    pool.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool._refcount[b] = 0  # used block with no reference
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    pool._refcount[0] = 1  # free block with a reference
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    pool._free.append(0)  # on the free list twice
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    pool.allocate(1)
    pool._refcount[0] = -1
    with pytest.raises(AssertionError):
        pool.check_invariants()


_OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "incref", "free", "bad"]), st.integers(0, 10**6)), max_size=60
)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=_OPS)
def test_pool_random_ops(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Random allocate/incref/free/misuse against a reference model of the refcounts."""
    pool = BlockPool(num_blocks)
    model = [0] * num_blocks
    for op, k in ops:
        live = [b for b in range(num_blocks) if model[b] > 0]
        dead = [b for b in range(num_blocks) if model[b] == 0]
        if op == "alloc":
            n = k % (num_blocks + 2)
            if n > len(dead):
                before = pool_state(pool)
                with pytest.raises(RuntimeError):
                    pool.allocate(n)
                assert pool_state(pool) == before
            else:
                got = pool.allocate(n)
                assert len(set(got)) == n
                for b in got:
                    assert model[b] == 0, "allocated a block that is in use"
                    model[b] = 1
        elif op == "incref" and live:
            b = live[k % len(live)]
            pool.incref([b])
            model[b] += 1
        elif op == "free" and live:
            b = live[k % len(live)]
            pool.free([b])
            model[b] -= 1
        elif op == "bad" and dead:
            b = dead[k % len(dead)]
            before = pool_state(pool)
            with pytest.raises(RuntimeError):
                if k % 2:
                    pool.free([b])
                else:
                    pool.incref([b])
            assert pool_state(pool) == before
        pool.check_invariants()
        assert [pool.refcount(b) for b in range(num_blocks)] == model
        assert pool.num_free == model.count(0)
        assert pool.num_free + sum(1 for c in model if c) == num_blocks


# -- KVCacheManager ------------------------------------------------------


def test_cdiv_and_blocks_for() -> None:
    assert [cdiv(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    kv = KVCacheManager(10, 4)
    assert kv.blocks_for(0) == 0
    assert kv.blocks_for(1) == 1
    assert kv.blocks_for(4) == 1
    assert kv.blocks_for(5) == 2
    assert kv.num_blocks == 10
    assert kv.usage == 0.0


def test_allocate_slots_grows_exactly() -> None:
    kv = KVCacheManager(10, 4)
    req = make_req(10)
    copies: list[tuple[int, int]] = []
    assert kv.allocate_slots(req, 3, copies)
    assert len(req.block_ids) == 1
    req.num_computed_tokens = 3
    assert kv.allocate_slots(req, 1, copies)  # fills block 0 exactly
    assert len(req.block_ids) == 1
    req.num_computed_tokens = 4
    assert kv.allocate_slots(req, 6, copies)
    assert len(req.block_ids) == 3
    req.num_computed_tokens = 10
    assert copies == []
    check_accounting(kv.pool, [req])
    kv.free(req)
    assert req.block_ids == []
    assert kv.pool.num_free == 10
    check_accounting(kv.pool, [req])


def test_allocate_slots_short_changes_nothing() -> None:
    kv = KVCacheManager(4, 2)
    hog = make_req(6)
    assert kv.allocate_slots(hog, 6, [])
    hog.num_computed_tokens = 6
    req = make_req(8)
    assert kv.allocate_slots(req, 1, [])  # the last free block
    req.num_computed_tokens = 1
    before = (pool_state(kv.pool), list(req.block_ids), req.num_computed_tokens)
    copies: list[tuple[int, int]] = [(7, 7)]  # pre-existing entries must survive untouched
    assert not kv.allocate_slots(req, 3, copies)
    assert copies == [(7, 7)]
    assert (pool_state(kv.pool), list(req.block_ids), req.num_computed_tokens) == before
    check_accounting(kv.pool, [hog, req])
    # Writing into the block it already has still works with nothing free.
    assert kv.allocate_slots(req, 1, copies)
    assert copies == [(7, 7)]


def test_fork_shares_every_block() -> None:
    kv = KVCacheManager(8, 4)
    parent = make_req(6)
    assert kv.allocate_slots(parent, 6, [])
    parent.num_computed_tokens = 6
    child = make_req(6)
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert child.block_ids is not parent.block_ids
    assert all(kv.pool.refcount(b) == 2 for b in parent.block_ids)
    check_accounting(kv.pool, [parent, child])
    with pytest.raises(RuntimeError):
        kv.fork(parent, child)  # the child already holds blocks
    check_accounting(kv.pool, [parent, child])


def test_copy_on_write_of_partly_filled_shared_block() -> None:
    kv = KVCacheManager(8, 4)
    parent = make_req(6)
    assert kv.allocate_slots(parent, 6, [])
    parent.num_computed_tokens = 6
    child = make_req(6)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    full, partial = parent.block_ids

    copies: list[tuple[int, int]] = []
    assert kv.allocate_slots(child, 1, copies)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial
    assert dst not in (full, partial)
    assert child.block_ids == [full, dst]  # the full block stays shared, the written one is private
    assert parent.block_ids == [full, partial]
    assert kv.pool.refcount(full) == 2
    assert kv.pool.refcount(partial) == 1
    assert kv.pool.refcount(dst) == 1
    check_accounting(kv.pool, [parent, child])

    # The parent is now the only holder of its partial block: no copy for its write.
    copies2: list[tuple[int, int]] = []
    assert kv.allocate_slots(parent, 1, copies2)
    assert copies2 == []
    assert parent.block_ids == [full, partial]

    kv.free(parent)
    check_accounting(kv.pool, [parent, child])
    kv.free(child)
    assert kv.pool.num_free == 8
    check_accounting(kv.pool, [parent, child])


def test_no_copy_when_shared_blocks_are_full() -> None:
    kv = KVCacheManager(8, 4)
    parent = make_req(8)
    assert kv.allocate_slots(parent, 8, [])
    parent.num_computed_tokens = 8
    child = make_req(8)
    kv.fork(parent, child)
    child.num_computed_tokens = 8
    copies: list[tuple[int, int]] = []
    assert kv.allocate_slots(child, 1, copies)
    assert copies == []
    assert child.block_ids[:2] == parent.block_ids
    assert len(child.block_ids) == 3
    check_accounting(kv.pool, [parent, child])


def test_copy_on_write_needs_a_free_block() -> None:
    kv = KVCacheManager(2, 4)
    parent = make_req(6)
    assert kv.allocate_slots(parent, 6, [])
    parent.num_computed_tokens = 6
    child = make_req(6)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    before = (pool_state(kv.pool), list(child.block_ids))
    copies: list[tuple[int, int]] = []
    assert not kv.allocate_slots(child, 1, copies)
    assert copies == []
    assert (pool_state(kv.pool), list(child.block_ids)) == before
    check_accounting(kv.pool, [parent, child])
    kv.free(parent)  # now the child is the only holder: it can write in place
    assert kv.allocate_slots(child, 2, copies)
    assert copies == []
    check_accounting(kv.pool, [parent, child])


def test_copy_on_write_spanning_several_shared_blocks() -> None:
    """Every shared block in the written range gets a private copy, in table order."""
    kv = KVCacheManager(12, 2)
    parent = make_req(6)
    assert kv.allocate_slots(parent, 6, [])
    parent.num_computed_tokens = 6
    child = make_req(6)
    kv.fork(parent, child)
    child.num_computed_tokens = 1  # rewrite from inside the first block
    copies: list[tuple[int, int]] = []
    assert kv.allocate_slots(child, 6, copies)  # positions 1..6: blocks 0, 1, 2 shared, 3 new
    assert [s for s, _ in copies] == parent.block_ids
    assert child.block_ids[:3] == [d for _, d in copies]
    assert len(child.block_ids) == 4
    assert not set(child.block_ids) & set(parent.block_ids)
    check_accounting(kv.pool, [parent, child])


def test_three_way_fork_copies_until_last_holder() -> None:
    kv = KVCacheManager(8, 4)
    leader = make_req(3)
    assert kv.allocate_slots(leader, 3, [])
    leader.num_computed_tokens = 3
    kids = [make_req(3) for _ in range(2)]
    for k in kids:
        kv.fork(leader, k)
        k.num_computed_tokens = 3
    (shared,) = leader.block_ids
    assert kv.pool.refcount(shared) == 3
    c1: list[tuple[int, int]] = []
    assert kv.allocate_slots(kids[0], 1, c1)
    assert c1[0][0] == shared and kv.pool.refcount(shared) == 2
    c2: list[tuple[int, int]] = []
    assert kv.allocate_slots(leader, 1, c2)
    assert c2[0][0] == shared and kv.pool.refcount(shared) == 1
    c3: list[tuple[int, int]] = []
    assert kv.allocate_slots(kids[1], 1, c3)
    assert c3 == [] and kids[1].block_ids == [shared]
    check_accounting(kv.pool, [leader, *kids])
    for r in (leader, *kids):
        kv.free(r)
    assert kv.pool.num_free == 8


# -- a stateful model of the KV cache manager ---------------------------


class KVMachine(RuleBasedStateMachine):
    """Sequences grow, fork and are freed; a simulated KV store checks what each sequence would read.

    Every written slot holds a unique value; a sequence's expected contents are the values it (or the
    ancestor it forked from) wrote. Copy-on-write must keep each sequence reading its own values, and
    no write may land in a block that another sequence still holds.
    """

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager
        self.live: list[Request] = []
        self.expected: dict[str, list[int]] = {}
        self.store: dict[int, list[int | None]] = {}
        self.values = itertools.count()

    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)
        self.store = {b: [None] * block_size for b in range(num_blocks)}

    def _is_live(self, req: Request) -> bool:
        return any(r is req for r in self.live)

    def _write(self, req: Request, n: int) -> bool:
        pool = self.kv.pool
        before = (pool_state(pool), list(req.block_ids))
        copies: list[tuple[int, int]] = []
        ok = self.kv.allocate_slots(req, n, copies)
        if not ok:
            assert copies == []
            assert (pool_state(pool), list(req.block_ids)) == before
            needed = max(0, self.kv.blocks_for(req.num_computed_tokens + n) - len(req.block_ids))
            first = req.num_computed_tokens // self.kv.block_size
            shared = sum(1 for b in req.block_ids[first:] if pool.refcount(b) > 1)
            assert needed + shared > pool.num_free, "allocate_slots refused although the pool had room"
            event("allocate_slots refused")
            return False
        if copies:
            event("copy-on-write")
        for src, dst in copies:
            assert pool.refcount(dst) == 1
            self.store[dst] = list(self.store[src])
        bs = self.kv.block_size
        start = req.num_computed_tokens
        assert len(req.block_ids) == self.kv.blocks_for(start + n)
        for pos in range(start, start + n):
            block = req.block_ids[pos // bs]
            assert pool.refcount(block) == 1, f"write into shared block {block}"
            v = next(self.values)
            self.store[block][pos % bs] = v
            self.expected[req.request_id].append(v)
        req.num_computed_tokens += n
        return True

    @rule(target=seqs, n=st.integers(1, 10))
    def new_seq(self, n: int):
        req = make_req(n)
        self.expected[req.request_id] = []
        if self._write(req, n):
            self.live.append(req)
            return req
        assert req.block_ids == [] and req.num_computed_tokens == 0
        return multiple()

    @rule(req=seqs, n=st.integers(1, 6))
    def extend(self, req: Request, n: int) -> None:
        if self._is_live(req):
            self._write(req, n)

    @rule(target=seqs, req=seqs)
    def fork(self, req: Request):
        if not self._is_live(req):
            return multiple()
        child = make_req()
        self.kv.fork(req, child)
        child.num_computed_tokens = req.num_computed_tokens
        self.expected[child.request_id] = list(self.expected[req.request_id])
        self.live.append(child)
        return child

    @rule(req=consumes(seqs))
    def free(self, req: Request) -> None:
        if self._is_live(req):
            self.kv.free(req)
            assert req.block_ids == []
            self.live = [r for r in self.live if r is not req]

    @rule(block=st.integers(0, 15))
    def double_free_raises(self, block: int) -> None:
        block %= self.kv.num_blocks
        if self.kv.pool.refcount(block) == 0:
            before = pool_state(self.kv.pool)
            with pytest.raises(RuntimeError):
                self.kv.pool.free([block])
            assert pool_state(self.kv.pool) == before

    @invariant()
    def accounting(self) -> None:
        check_accounting(self.kv.pool, self.live)
        bs = self.kv.block_size
        for r in self.live:
            assert len(r.block_ids) == self.kv.blocks_for(r.num_computed_tokens)
            seen = [self.store[r.block_ids[p // bs]][p % bs] for p in range(r.num_computed_tokens)]
            assert seen == self.expected[r.request_id], f"{r.request_id} reads another sequence's KV"

    def teardown(self) -> None:
        if hasattr(self, "kv"):
            for r in self.live:
                self.kv.free(r)
            assert self.kv.pool.num_free == self.kv.num_blocks
            self.kv.pool.check_invariants()


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_only_the_core_touches_the_pool_and_block_tables():
    """The KV manager owns the pool and every request's block table: other packages go through
    its methods (take_blocks, hold, drop, give), so its invariants have one keeper."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "tandem"
    # Synthetic requests that time a forward pass over made-up blocks, never the pool's.
    synthetic = {"worker/model_runner.py"}
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("core/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.pool\.", line) or (
                rel not in synthetic and re.search(r"\.block_ids\s*(=|\+=)|\.block_ids\.(append|extend)", line)
            ):
                offenders.append(f"tandem/{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
