"""Maps requests to KV blocks: grows block tables, reuses cached prefixes, shares on fork, copies on write."""

from __future__ import annotations

from tandem.core.block_pool import BlockPool
from tandem.core.prefix_cache import Node, PrefixCache
from tandem.core.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    __slots__ = ("block_size", "cache", "pool", "swap_pool")

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_swap_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        # The swap space: host blocks holding swapped-out requests' KV (None: no swap).
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None

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
        if req.status == RequestStatus.SWAPPED:
            return req.num_computed_tokens  # all of its KV is kept
        if self.cache is None or req.owes_prompt_logprobs:
            return 0
        return self.cache.match_len(req.token_ids[: req.num_tokens - 1], req.cache_salt)

    def blocks_to_admit(self, req: Request) -> int:
        """Blocks that admitting `req` (with no blocks) and computing its tokens takes out of
        `num_available`: those beyond its cached prefix, plus the prefix blocks idle now (matching
        locks them, so they stop counting as available). A swapped request needs its swapped blocks
        back, those its remaining tokens take and copies of kept shared blocks it writes into (at
        most: swap-in may find some of its blocks still cached)."""
        if req.status == RequestStatus.SWAPPED:
            kept, table = req.block_ids, len(req.block_ids) + len(req.host_block_ids)
            first = req.num_computed_tokens // self.block_size
            shared = sum(self.pool.refcount(kept[i]) > 1 for i in range(first, len(kept)))
            return len(req.host_block_ids) + max(0, self.blocks_for(req.num_tokens) - table) + shared
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
        """Drop a request's blocks; its computed full blocks go to the prefix cache first (not those
        of a swapped-out request: its table is partly in host blocks, which are dropped too)."""
        if self.cache is not None:
            if cache and not req.host_block_ids:
                self.cache_computed(req)
            node = req.prefix_node
            if isinstance(node, Node):
                self.cache.unlock(node)
            req.prefix_node = None
        self.pool.free(req.block_ids)
        req.block_ids = []
        if req.host_block_ids:
            assert self.swap_pool is not None, "host blocks without a swap space"
            self.swap_pool.free(req.host_block_ids)
            req.host_block_ids = []

    # -- swap: preemption that keeps a request's KV, in host memory --------------------------------

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_pool.num_blocks if self.swap_pool is not None else 0

    def swap_plan(self, req: Request) -> tuple[int, int]:
        """What `swap_out` would do to `req` now, read-only: (blocks it would copy to host memory,
        leading blocks it would keep on the device). It keeps the leading blocks another request
        holds too (a shared prefix, a fork's prompt): they stay on the device anyway, so copying
        them would free nothing. Blocks past its computed tokens (rejected drafts' slots) hold
        nothing to keep and are just freed."""
        table = req.block_ids[: self.blocks_for(req.num_computed_tokens)]
        node = req.prefix_node
        cached = node.end // self.block_size if isinstance(node, Node) else 0
        keep = 0
        # Besides this request's own reference, the prefix cache holds one on the blocks of its path.
        while keep < len(table) and self.pool.refcount(table[keep]) > 1 + (keep < cached):
            keep += 1
        return len(table) - keep, keep

    def swap_out(self, req: Request, copies: list[tuple[int, int]]) -> bool:
        """Preempt `req` by swap: its computed blocks but the kept ones (`swap_plan`) get host blocks,
        the `(device, host)` pairs appended to `copies` for the runner to copy before anything
        overwrites them, and the request drops its device references; it keeps
        `num_computed_tokens`. Its cached blocks past the kept ones stay in the prefix cache,
        unlocked (evictable), and `swap_in` takes them back from there if they are still cached.
        Returns False, changing nothing, if there is no swap space or not enough of it free."""
        num_swap, keep = self.swap_plan(req)
        if self.swap_pool is None or num_swap > self.swap_pool.num_free:
            return False
        bs, table = self.block_size, req.block_ids
        host = self.swap_pool.allocate(num_swap)
        copies.extend(zip(table[keep : keep + num_swap], host))
        node = req.prefix_node
        if self.cache is not None and isinstance(node, Node) and keep * bs < node.end:
            # Lock only the path up to the kept blocks (split there if a node straddles the point).
            _, kept_node = self.cache.match(req.token_ids[: keep * bs], req.cache_salt)
            self.cache.lock(kept_node)
            self.cache.unlock(node)
            req.prefix_node = kept_node
        self.pool.free(table[keep:])
        req.block_ids = table[:keep]
        req.host_block_ids = host
        return True

    def swap_out_kept(self, req: Request, copies: list[tuple[int, int]]) -> bool:
        """A swapped-out request's kept device blocks go to host memory too (`(device, host)` pairs
        appended to `copies`), so it holds no device block and no prefix-cache path but its root.
        Returns False, changing nothing, if the swap space has no room for them."""
        kept = req.block_ids
        if self.swap_pool is None or len(kept) > self.swap_pool.num_free:
            return False
        host = self.swap_pool.allocate(len(kept))
        copies.extend(zip(kept, host))
        node = req.prefix_node
        if self.cache is not None and isinstance(node, Node) and node.parent is not None:
            root = node
            while root.parent is not None:
                root = root.parent
            self.cache.lock(root)
            self.cache.unlock(node)
            req.prefix_node = root
        self.pool.free(kept)
        req.block_ids = []
        req.host_block_ids = host + req.host_block_ids
        return True

    def swap_in(
        self,
        req: Request,
        num_new_tokens: int,
        copies: list[tuple[int, int]],
        swap_copies: list[tuple[int, int]],
    ) -> bool:
        """Give a swapped-out request its blocks back and room for `num_new_tokens` more tokens (as
        `allocate_slots`, copy-on-write pairs appended to `copies`). Swapped blocks the prefix
        cache still holds (on the request's path) are taken from there; the others go into fresh
        blocks, the `(host, device)` pairs appended to `swap_copies`. The host blocks are free again
        once this returns: within a step every swap-out is planned before any swap-in, and the
        runner copies out before in. Returns False, changing nothing, if the blocks cannot be had."""
        bs, keep, host = self.block_size, len(req.block_ids), req.host_block_ids
        length = keep + len(host)
        start = req.num_computed_tokens
        end = start + num_new_tokens
        reuse: list[int] = []
        node: Node | None = None
        if self.cache is not None:
            full = min(start // bs, length)
            matched, _ = self.cache.match_stats(req.token_ids[: full * bs], req.cache_salt)
            if matched // bs > keep:
                blocks, node = self.cache.match(req.token_ids[:matched], req.cache_salt)
                if blocks[:keep] == req.block_ids:
                    reuse = blocks[keep:]
                    self.pool.incref(reuse)
                    self.cache.lock(node)  # before make_free below, which would evict them
                else:
                    node = None
        table = req.block_ids + reuse
        first, last = start // bs, min(len(table), self.blocks_for(end))
        shared = sum(self.pool.refcount(table[i]) > 1 for i in range(first, last))
        num_fresh = len(host) - len(reuse)
        if not self.make_free(num_fresh + max(0, self.blocks_for(end) - length) + shared):
            if node is not None:
                assert self.cache is not None
                self.cache.unlock(node)
                self.pool.free(reuse)
            return False
        fresh = self.pool.allocate(num_fresh)
        swap_copies.extend(zip(host[len(reuse) :], fresh))
        assert self.swap_pool is not None, "a swapped request without a swap space"
        self.swap_pool.free(host)
        if node is not None:
            assert self.cache is not None
            if isinstance(req.prefix_node, Node):
                self.cache.unlock(req.prefix_node)
            req.prefix_node = node
        req.block_ids = table + fresh
        req.host_block_ids = []
        if not self.allocate_slots(req, num_new_tokens, copies):
            raise RuntimeError(f"swap-in of request {req.request_id} found fewer blocks than it made free")
        return True

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.swap_pool is not None:
            self.swap_pool.check_invariants()
        if self.cache is not None:
            self.cache.check_invariants()
