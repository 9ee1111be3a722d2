"""Maps requests to KV blocks: grows block tables, shares blocks on fork, copies on write."""

from __future__ import annotations

from tandem.core.block_pool import BlockPool
from tandem.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    __slots__ = ("block_size", "pool")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, req: Request, num_new_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Make room for KV of `num_new_tokens` tokens after `req.num_computed_tokens`.

        Blocks about to be written that are shared with another request are
        replaced by private copies first; the (src, dst) pairs are appended to
        `copies` for the runner to copy before the step runs. Returns False,
        changing nothing, if the pool cannot supply the blocks.
        """
        start = req.num_computed_tokens
        end = start + num_new_tokens
        table = req.block_ids
        num_new = max(0, self.blocks_for(end) - len(table))
        first = start // self.block_size
        last = min(len(table), self.blocks_for(end))
        shared = [i for i in range(first, last) if self.pool.refcount(table[i]) > 1]
        if num_new + len(shared) > self.pool.num_free:
            return False
        for i in shared:
            (dst,) = self.pool.allocate(1)
            copies.append((table[i], dst))
            self.pool.free([table[i]])
            table[i] = dst
        if num_new:
            table.extend(self.pool.allocate(num_new))
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share every block of `parent` (copy-on-write happens on the next write)."""
        if child.block_ids:
            raise RuntimeError(f"fork into request {child.request_id} that already holds blocks")
        self.pool.incref(parent.block_ids)
        child.block_ids = list(parent.block_ids)

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
