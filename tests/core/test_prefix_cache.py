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


# -- one root per salt, and only while it holds something ------------------------------------------


def test_a_salts_root_goes_when_its_last_block_is_evicted():
    # 10,000 distinct salts through a cache of 8 blocks: every salt's tree is evicted in turn, and
    # its root must go with it (each root used to stay forever: memory grew with every salt seen).
    pool, cache = cache_with(8, 4)
    tokens = list(range(8))  # two blocks per salt
    for i in range(10_000):
        if pool.num_free < 2:
            cache.evict(2 - pool.num_free)
        put(pool, cache, tokens, salt=f"salt-{i}")
        assert len(cache.roots) <= cache.num_cached_blocks
    assert cache.match_len(tokens, "salt-9999") == 8  # the newest is still cached
    assert cache.match_len(tokens, "salt-0") == 0
    cache.check_invariants()
    cache.evict(8)
    assert cache.roots == {} and pool.num_free == 8
    cache.check_invariants()
    pool.check_invariants()


def test_a_root_a_request_still_holds_is_kept():
    pool, cache = cache_with(8, 2)
    # A request of salt "s" that matched nothing holds the root of "s" (it will extend it).
    blocks, node = cache.match([1, 2, 3, 4], "s")
    assert blocks == [] and node.is_root
    cache.lock(node)
    # Another request of "s" caches a block, which is then evicted: the root stays, held.
    put(pool, cache, [7, 7], salt="s")
    assert cache.evict(8) == 1
    assert cache.roots.get("s") is node
    cache.check_invariants()
    # The holder's blocks land in the tree its salt's lookups search.
    mine = pool.allocate(2)
    new = cache.extend(node, [1, 2, 3, 4], mine)
    cache.lock(new)
    cache.unlock(node)
    pool.free(mine)
    assert cache.match_len([1, 2, 3, 4], "s") == 4
    assert cache.match_len([1, 2, 3, 4], "t") == 0 and cache.match_len([1, 2, 3, 4], None) == 0
    cache.unlock(new)
    cache.check_invariants()
    cache.evict(8)
    assert cache.roots == {} and pool.num_free == 8


def test_a_request_that_caches_nothing_leaves_no_root():
    pool, cache = cache_with(8, 4)
    for i in range(100):
        _, node = cache.match([1, 2, 3], f"short-{i}")  # under one block: nothing to cache
        cache.lock(node)
        cache.unlock(node)
        put(pool, cache, [5, 6], salt=f"tiny-{i}")
    assert cache.roots == {}
    cache.check_invariants()


def test_requests_skipping_the_cache_leave_no_root_behind():
    # A request owed prompt logprobs reads nothing from the cache (it holds no node) but caches what
    # it computes; one that computed less than a block caches nothing and must make no root.
    from tandem.core.kv_cache_manager import KVCacheManager
    from tandem.core.request import Request
    from tandem.sampling_params import SamplingParams

    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    assert kv.cache is not None
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    for i, prompt in enumerate(([1, 2, 3], [1, 2, 3, 4, 5, 6])):
        req = Request(f"r{i}", prompt, params, 1, cache_salt=f"s{i}")
        assert kv.match_prefix(req) == 0 and req.prefix_node is None
        assert kv.allocate_slots(req, len(prompt), [])
        req.num_computed_tokens = len(prompt)
        kv.free(req)
        kv.check_invariants()
    assert set(kv.cache.roots) == {"s1"}  # only the one that cached a whole block
    kv.cache.evict(16)
    assert kv.cache.roots == {} and kv.pool.num_free == 16


def test_memory_stays_flat_under_ten_thousand_distinct_salts():
    """Requests with a fresh salt each (of the longest length accepted), through the KV manager as
    the scheduler drives it: what the cache holds after 10,000 salts is what it held after 2,000
    (before, every salt's root and key stayed: about 1.3 KB each here, 13 MB in all)."""
    import tracemalloc

    from tandem.core.kv_cache_manager import KVCacheManager
    from tandem.core.limits import MAX_CACHE_SALT_CHARS
    from tandem.core.request import Request
    from tandem.sampling_params import SamplingParams

    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    assert kv.cache is not None
    params = SamplingParams(max_tokens=1)
    prompt = list(range(9))  # two whole blocks cached per request

    def run(first: int, last: int) -> None:
        for i in range(first, last):
            salt = f"{i:08d}".ljust(MAX_CACHE_SALT_CHARS, "s")
            req = Request(f"r{i}", prompt, params, 1, cache_salt=salt)
            kv.match_prefix(req)
            if not kv.allocate_slots(req, len(prompt) - req.num_computed_tokens, []):
                raise AssertionError("a request that fits an emptied cache found no room")
            req.num_computed_tokens = len(prompt)
            kv.free(req)

    tracemalloc.start()
    try:
        run(0, 2000)
        before = tracemalloc.get_traced_memory()[0]
        run(2000, 10_000)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 256 << 10, f"grew {after - before} bytes over 8,000 salts"
    assert len(kv.cache.roots) <= kv.cache.num_cached_blocks <= 32
    kv.check_invariants()
