"""A pool of KV cache block ids with a free list and reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids; a block returns to the free list when its last reference is dropped.

    Reference counts let several sequences share a block (the prompt of an
    `n > 1` request, later cached prefixes). Misuse (freeing a free block,
    allocating more than is free) raises instead of corrupting the pool.
    """

    __slots__ = ("_free", "_refcount", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
        return out

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._refcount[b] <= 0:
                raise RuntimeError(f"incref of free KV block {b}")
            self._refcount[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (in order); blocks reaching zero become free."""
        for b in block_ids:
            rc = self._refcount[b]
            if rc <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._refcount[b] = rc - 1
            if rc == 1:
                self._free.append(b)

    def check_invariants(self) -> None:
        """Raise if the free list and the refcounts disagree (used by tests)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a KV block is on the free list twice")
        for b, rc in enumerate(self._refcount):
            if rc < 0:
                raise AssertionError(f"KV block {b} has negative refcount {rc}")
            if (rc == 0) != (b in free):
                raise AssertionError(f"KV block {b}: refcount {rc} but free={b in free}")
