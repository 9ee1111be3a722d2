"""The radix-tree prefix cache on its own: matching, splitting, locking, LRU eviction, invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.block_pool import BlockPool
from tandem.core.prefix_cache import PrefixCache


def cache_with(num_blocks: int, bs: int) -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(num_blocks)
    return pool, PrefixCache(pool, bs)


def put(pool: BlockPool, cache: PrefixCache, tokens: list[int], salt: str | None = None) -> list[int]:
    """Simulate a request that computed `tokens` (whole blocks), inserted them, then released its refs."""
    n = len(tokens) // cache.block_size
    blocks = pool.allocate(n)
    cache.insert(tokens[: n * cache.block_size], blocks, salt)
    pool.free(blocks)
    return blocks


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_match_is_whole_blocks_and_diverges_mid_block(bs):
    pool, cache = cache_with(64, bs)
    base = list(range(100, 100 + 4 * bs))
    blocks = put(pool, cache, base)
    assert cache.match_len(base, None) == 4 * bs
    # Diverge in the middle of the third block: only two whole blocks match (token-level when bs=1).
    other = base[: 2 * bs + bs // 2] + [7] * (2 * bs)
    expected = 2 * bs + (bs // 2 if bs == 1 else 0)
    assert cache.match_len(other, None) == expected
    got, node = cache.match(other, None)
    assert got == blocks[: expected // bs]
    cache.check_invariants()
    assert node.lock == 0


def test_salts_never_share():
    pool, cache = cache_with(32, 4)
    tokens = list(range(16))
    put(pool, cache, tokens, salt="tenant-a")
    assert cache.match_len(tokens, "tenant-a") == 16
    assert cache.match_len(tokens, "tenant-b") == 0
    assert cache.match_len(tokens, None) == 0


def test_insert_keeps_existing_blocks_and_adopts_only_new():
    pool, cache = cache_with(32, 2)
    put(pool, cache, [1, 2, 3, 4])
    fresh = pool.allocate(3)
    node = cache.insert([1, 2, 3, 4, 5, 6], fresh, None)
    assert node.end == 6 and node.blocks == [fresh[2]]  # only the block for [5, 6] is adopted
    pool.free(fresh)
    # The duplicate blocks went back to the pool; the tree still owns 3 blocks.
    assert cache.num_cached_blocks == 3
    assert pool.num_used == 3
    cache.check_invariants()
    pool.check_invariants()


def test_locked_blocks_are_never_evicted_and_lru_order():
    pool, cache = cache_with(32, 2)
    put(pool, cache, [1, 2, 3, 4])  # older
    put(pool, cache, [9, 9, 8, 8])  # newer
    _, node = cache.match([1, 2, 3, 4], None)  # touch: now the newest
    cache.lock(node)
    assert cache.num_unlocked_blocks == 2
    freed = cache.evict(10)
    assert freed == 2
    assert cache.match_len([9, 9, 8, 8], None) == 0
    assert cache.match_len([1, 2, 3, 4], None) == 4
    cache.unlock(node)
    assert cache.evict(1) == 1  # the tail block of the leaf only
    assert cache.match_len([1, 2, 3, 4], None) == 2
    cache.check_invariants()
    pool.check_invariants()


def test_lru_evicts_least_recent_first():
    pool, cache = cache_with(32, 1)
    put(pool, cache, [1, 2])
    put(pool, cache, [3, 4])
    cache.match([1, 2], None)
    cache.evict(2)
    assert cache.match_len([1, 2], None) == 2
    assert cache.match_len([3, 4], None) == 0


@settings(max_examples=60, deadline=None)
@given(
    bs=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 10_000),
    ops=st.lists(st.sampled_from(["put", "use", "release", "evict"]), min_size=5, max_size=60),
)
def test_random_operations_keep_invariants(bs, seed, ops):
    rng = random.Random(seed)
    num_blocks = 48
    pool, cache = cache_with(num_blocks, bs)
    # A few shared stems so prompts overlap at many depths.
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    held: list[tuple[list[int], object]] = []  # (blocks held by a "request", locked node)

    def prompt() -> list[int]:
        return rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]

    for op in ops:
        if op == "put":
            tokens = prompt()
            n = len(tokens) // bs
            if n and pool.num_free + cache.num_unlocked_blocks >= n:
                if pool.num_free < n:
                    cache.evict(n - pool.num_free)
                if pool.num_free >= n:
                    put(pool, cache, tokens)
        elif op == "use":
            blocks, node = cache.match(prompt(), None)
            pool.incref(blocks)
            cache.lock(node)
            held.append((blocks, node))
        elif op == "release" and held:
            blocks, node = held.pop(rng.randrange(len(held)))
            cache.unlock(node)
            pool.free(blocks)
        elif op == "evict":
            locked_blocks = {b for blocks, _ in held for b in blocks}
            cache.evict(rng.randrange(1, 6))
            for b in locked_blocks:
                assert pool.refcount(b) >= 1, "eviction freed a block a request holds"
        cache.check_invariants()
        pool.check_invariants()
        # Conservation: every used block is owned by the tree or held by a request.
        owned = cache.num_cached_blocks
        assert pool.num_free + owned >= num_blocks - sum(len(b) for b, _ in held)
        assert pool.num_free + pool.num_used == num_blocks

    for blocks, node in held:
        cache.unlock(node)
        pool.free(blocks)
    assert cache.num_unlocked_blocks == cache.num_cached_blocks  # lock counts back to zero
    cache.evict(num_blocks)
    assert pool.num_free == num_blocks
    cache.check_invariants()
    pool.check_invariants()
