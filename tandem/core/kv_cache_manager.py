"""Maps requests to KV blocks: grows block tables, reuses cached prefixes, shares on fork, copies on write."""

from __future__ import annotations

from tandem.core.block_pool import BlockPool
from tandem.core.prefix_cache import Node, PrefixCache
from tandem.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    __slots__ = ("block_size", "cache", "num_hit_tokens", "num_query_tokens", "pool")

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-idle blocks count as free)."""
        idle = self.cache.num_unlocked_blocks if self.cache else 0
        return max(0, self.pool.num_used - idle) / self.pool.num_blocks

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free ones plus idle cached ones that eviction would release."""
        return self.pool.num_free + (self.cache.num_unlocked_blocks if self.cache else 0)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def make_free(self, n: int) -> bool:
        """Make `n` blocks free (evicting idle cached prefixes if need be); False if they cannot be."""
        if n > self.pool.num_free and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        return n <= self.pool.num_free

    def allocate_slots(self, req: Request, num_new_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Make room for KV of `num_new_tokens` tokens after `req.num_computed_tokens`.

        Blocks about to be written that are shared with another request are
        replaced by private copies first; the (src, dst) pairs are appended to
        `copies` for the runner to copy before the step runs. Idle cached
        prefixes are evicted if the pool is short. Returns False, changing no
        request, if the blocks cannot be had.
        """
        start = req.num_computed_tokens
        end = start + num_new_tokens
        table = req.block_ids
        num_new = max(0, self.blocks_for(end) - len(table))
        first = start // self.block_size
        last = min(len(table), self.blocks_for(end))
        shared = [i for i in range(first, last) if self.pool.refcount(table[i]) > 1]
        if not self.make_free(num_new + len(shared)):
            return False
        for i in shared:
            (dst,) = self.pool.allocate(1)
            copies.append((table[i], dst))
            self.pool.free([table[i]])
            table[i] = dst
        if num_new:
            table.extend(self.pool.allocate(num_new))
        return True

    # -- prefix cache ----------------------------------------------------

    def match_len(self, req: Request) -> int:
        """Tokens of `req` a cached prefix would cover (read-only; for ordering the queue)."""
        if self.cache is None or req.owes_prompt_logprobs:
            return 0
        return self.cache.match_len(req.token_ids[: req.num_tokens - 1], req.cache_salt)

    def blocks_to_admit(self, req: Request) -> int:
        """Blocks that admitting `req` (with no blocks) and computing its tokens takes out of
        `num_available`: those beyond its cached prefix, plus the prefix blocks idle now (matching
        locks them, so they stop counting as available)."""
        if self.cache is None or req.owes_prompt_logprobs:
            return self.blocks_for(req.num_tokens)
        matched, idle = self.cache.match_stats(req.token_ids[: req.num_tokens - 1], req.cache_salt)
        return self.blocks_for(req.num_tokens) - matched // self.block_size + idle

    def match_prefix(self, req: Request) -> int:
        """Give a request with no blocks its longest cached prefix; returns the tokens covered.

        At least the last token is always left to compute, so its logits exist.

        A request still owed prompt logprobs takes nothing from the cache: a cached prefix has KV
        but no logits, and its logprobs need the logits of every prompt position, so the prefix
        would be computed again anyway (as vLLM does, it skips reading the cache; its blocks still
        go into the cache for others).
        """
        if self.cache is None or req.block_ids or req.owes_prompt_logprobs:
            return 0
        blocks, node = self.cache.match(req.token_ids[: req.num_tokens - 1], req.cache_salt)
        self.pool.incref(blocks)
        self.cache.lock(node)
        req.prefix_node = node
        req.block_ids = blocks
        req.num_computed_tokens = len(blocks) * self.block_size
        return req.num_computed_tokens

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share every block of `parent` (copy-on-write happens on the next write)."""
        if child.block_ids:
            raise RuntimeError(f"fork into request {child.request_id} that already holds blocks")
        # Cache the parent's computed blocks first, so the child locks the node covering every cached
        # block it shares (else those blocks could count as idle in the cache while the child holds them).
        self.cache_computed(parent)
        self.pool.incref(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        if parent.prefix_node is not None and self.cache is not None:
            self.cache.lock(parent.prefix_node)  # type: ignore[arg-type]
            child.prefix_node = parent.prefix_node

    def cache_computed(self, req: Request) -> None:
        """Put the request's newly computed full blocks in the prefix cache and move its lock down.

        Done every step, not only at the end, so requests running at the same
        time share a prefix as soon as one of them has computed it.
        """
        if self.cache is None:
            return
        node = req.prefix_node
        bs = self.block_size
        full = req.num_computed_tokens // bs
        if not isinstance(node, Node):
            if full == 0:
                return  # nothing to cache: no root made for it (an empty one would outlive it)
            node = self.cache.root(req.cache_salt)
        start = node.end // bs
        if full <= start:
            return
        new = self.cache.extend(node, req.token_ids[start * bs : full * bs], req.block_ids[start:full])
        # Where the tree already held these tokens (another request computed them first) it kept its
        # own blocks: switch to those and drop the duplicates, or the request would hold its copy and
        # lock the cached one too, two blocks for one, and could then not fit a cache it fits alone.
        cached: list[int] = []
        n: Node | None = new
        while n is not node:
            assert n is not None, "extend() returns `node` or a descendant of it"
            cached[:0] = n.blocks
            n = n.parent
        for i, b in enumerate(cached, start):
            if req.block_ids[i] != b:
                self.pool.incref([b])
                self.pool.free([req.block_ids[i]])
                req.block_ids[i] = b
        self.cache.lock(new)
        if req.prefix_node is not None:
            self.cache.unlock(node)
        req.prefix_node = new

    # -- blocks outside the scheduler's requests (KV transfers): the manager keeps the pool ----------

    def take_blocks(self, n: int) -> list[int] | None:
        """`n` blocks for KV arriving from elsewhere (one reference each, the caller's), or None if
        they cannot be had."""
        return self.pool.allocate(n) if self.make_free(n) else None

    def hold(self, block_ids: list[int]) -> None:
        """Take one more reference on these blocks."""
        self.pool.incref(block_ids)

    def drop(self, block_ids: list[int]) -> None:
        """Give one reference on these blocks back."""
        self.pool.free(block_ids)

    def give(self, req: Request, block_ids: list[int], add_reference: bool) -> None:
        """Make these filled blocks `req`'s block table (a request that arrives with its KV): with
        `add_reference` it takes a reference of its own, else the caller's passes to it."""
        if req.block_ids:
            raise RuntimeError(f"request {req.request_id} already has blocks")
        if add_reference:
            self.pool.incref(block_ids)
        req.block_ids = list(block_ids)

    def free(self, req: Request, cache: bool = True) -> None:
        """Drop a request's blocks; its computed full blocks go to the prefix cache first."""
        if self.cache is not None:
            if cache:
                self.cache_computed(req)
            node = req.prefix_node
            if isinstance(node, Node):
                self.cache.unlock(node)
            req.prefix_node = None
        self.pool.free(req.block_ids)
        req.block_ids = []

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.cache is not None:
            self.cache.check_invariants()
