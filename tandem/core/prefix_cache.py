"""Prefix cache: a radix tree over token ids whose nodes own KV blocks.

Keys are matched in whole blocks, so `block_size=1` gives token-level matching
(SGLang's default) and larger blocks give vLLM-style block matching, from the
same code. Each node's key is a run of tokens whose length is a multiple of the
block size, with one block id per `block_size` tokens; children are keyed by
their first block's tokens. The tree holds one pool reference on every block it
owns. Requests using a node's blocks lock the node and its ancestors; unlocked
leaves are evicted least-recently-used first when the pool needs blocks. Each
`cache_salt` has its own root, so requests with different salts never share. A root lives only
while its tree holds a block or a request holds the root (it counts the requests under it): a
client sending a fresh salt with every request must not grow the engine's memory without bound.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from collections import deque
from dataclasses import dataclass, field

from tandem.core.block_pool import BlockPool


def _salt_seed(salt: str | None) -> int:
    return 0 if salt is None else zlib.crc32(salt.encode()) + 1


def prefix_block_hashes(tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """One hash per whole block of `tokens`, each covering the block and everything before it (and
    the salt), as `PrefixCache.block_hashes` reports them: a prompt's leading hashes found in an
    instance's report are blocks that instance has cached. Deterministic across processes."""
    h = _salt_seed(salt)
    out = []
    for pos in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[pos : pos + block_size])))
        out.append(h)
    return out


@dataclass(slots=True, eq=False)
class Node:
    key: tuple[int, ...]
    blocks: list[int]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock: int = 0
    last_access: int = 0
    end: int = 0  # tokens from the root to the end of this node's key

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(slots=True, eq=False)
class Root(Node):
    """The top of one salt's tree; its `lock` counts the requests holding a node of the tree."""

    salt: str | None = None


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.roots: dict[str | None, Root] = {}
        self._clock = itertools.count(1)
        # Blocks owned by the tree in nodes no request has locked.
        self.num_unlocked_blocks = 0
        self.num_cached_blocks = 0
        # Bumped whenever the set of cached blocks changes (so a summary is rebuilt only then).
        self.version = 0
        # Eviction candidates, least recently used first: (last_access when pushed, seq, node). A
        # node is pushed whenever it may have become an unlocked leaf; entries gone stale (the node
        # was evicted, got children or a lock, or was used since) are skipped or re-pushed when
        # popped, so an eviction never walks the whole tree.
        self._lru: list[tuple[int, int, Node]] = []
        self._lru_seq = itertools.count()

    def root(self, salt: str | None) -> Root:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Root((), [], None, salt=salt)
        return root

    def _drop_if_empty(self, root: Node) -> None:
        """Forget a root that holds no block and that no request holds: nothing can reach it but
        a later request of its salt, which makes a new one."""
        if isinstance(root, Root) and not root.children and root.lock == 0 and self.roots.get(root.salt) is root:
            del self.roots[root.salt]

    # -- lookup ----------------------------------------------------------

    def match_len(self, tokens: list[int], salt: str | None) -> int:
        """Length in tokens of the longest cached prefix (whole blocks), without changing the tree."""
        return self.match_stats(tokens, salt)[0]

    def match_stats(self, tokens: list[int], salt: str | None) -> tuple[int, int]:
        """`match_len`, and how many of the matched blocks are idle (unlocked) now, read-only."""
        bs = self.block_size
        node: Node | None = self.roots.get(salt)
        pos = idle = 0
        while node is not None and pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + bs]))
            if child is None:
                break
            m = self._common_blocks(child, tokens, pos)
            pos += m * bs
            if child.lock == 0:
                idle += m
            if m < len(child.blocks):
                break
            node = child
        return pos, idle

    def match(self, tokens: list[int], salt: str | None) -> tuple[list[int], Node]:
        """Longest cached prefix: its blocks and the node it ends at (split so it ends exactly there)."""
        bs = self.block_size
        node: Node = self.root(salt)
        blocks: list[int] = []
        pos = 0
        now = next(self._clock)
        node.last_access = now
        while pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + bs]))
            if child is None:
                break
            m = self._common_blocks(child, tokens, pos)
            partial = m < len(child.blocks)
            if partial:
                child = self._split(child, m)
            child.last_access = now
            blocks.extend(child.blocks)
            pos += m * bs
            node = child
            if partial:
                break
        return blocks, node

    def _common_blocks(self, node: Node, tokens: list[int], pos: int) -> int:
        bs = self.block_size
        key = node.key
        m = 1  # the first block matched through the children dict
        while (
            m < len(node.blocks)
            and pos + (m + 1) * bs <= len(tokens)
            and key[m * bs : (m + 1) * bs] == tuple(tokens[pos + m * bs : pos + (m + 1) * bs])
        ):
            m += 1
        return m

    def _split(self, node: Node, m: int) -> Node:
        """Cut `node` after its first `m` blocks; return the new upper part (the lower part keeps `node`)."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None, "a split node is never a root: roots have no blocks"
        upper = Node(
            node.key[: m * bs],
            node.blocks[:m],
            parent,
            lock=node.lock,
            last_access=node.last_access,
            end=node.end - len(node.key) + m * bs,
        )
        parent.children[node.key[:bs]] = upper
        node.key = node.key[m * bs :]
        node.blocks = node.blocks[m:]
        node.parent = upper
        upper.children[node.key[:bs]] = node
        return upper

    # -- locking ---------------------------------------------------------

    def lock(self, node: Node | None) -> None:
        """Pin `node` and its ancestors, its root included (a held root is never dropped)."""
        while node is not None:
            if node.lock == 0:
                self.num_unlocked_blocks -= len(node.blocks)  # none for a root
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None:
            if node.lock <= 0:
                raise RuntimeError("unlock of an unlocked prefix-cache node")
            node.lock -= 1
            if node.is_root:
                self._drop_if_empty(node)
            elif node.lock == 0:
                self.num_unlocked_blocks += len(node.blocks)
                self._candidate(node)
            node = node.parent

    def _candidate(self, node: Node) -> None:
        """Note that `node` may now be evictable (an unlocked leaf)."""
        if node.lock == 0 and not node.children and not node.is_root:
            heapq.heappush(self._lru, (node.last_access, next(self._lru_seq), node))
            if len(self._lru) > 4 * (self.num_cached_blocks + 256):  # mostly stale entries: rebuild
                self._lru = [(n.last_access, next(self._lru_seq), n) for n in self._leaves() if n.lock == 0]
                heapq.heapify(self._lru)

    # -- insertion and eviction -----------------------------------------

    def insert(self, tokens: list[int], blocks: list[int], salt: str | None) -> Node:
        """Cache `blocks` as holding KV of `tokens` from the root of `salt`'s tree; see `extend`."""
        root = self.root(salt)
        node = self.extend(root, tokens, blocks)
        self._drop_if_empty(root)  # no whole block given
        return node

    def extend(self, node: Node, tokens: list[int], blocks: list[int]) -> Node:
        """Cache `blocks` as the KV of `tokens` following the prefix that ends at `node`.

        `len(tokens) == len(blocks) * block_size`. Where the tree already holds
        these tokens it keeps its own blocks (the caller's duplicates are not
        adopted); the rest is added as a new leaf. Returns the node at which
        `tokens` end (split if that falls inside a node).
        """
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError("the prefix cache needs exactly block_size tokens per block")
        pos = 0
        now = next(self._clock)
        node.last_access = now
        while pos < len(tokens):
            head = tuple(tokens[pos : pos + bs])
            child = node.children.get(head)
            if child is None:
                new = Node(
                    tuple(tokens[pos:]),
                    list(blocks[pos // bs :]),
                    node,
                    last_access=now,
                    end=node.end + len(tokens) - pos,
                )
                node.children[head] = new
                self.version += 1
                self.pool.incref(new.blocks)
                self.num_unlocked_blocks += len(new.blocks)
                self.num_cached_blocks += len(new.blocks)
                self._candidate(new)
                return new
            m = self._common_blocks(child, tokens, pos)
            if m < len(child.blocks):
                child = self._split(child, m)
            child.last_access = now
            pos += m * bs
            node = child
        return node

    def _in_tree(self, node: Node) -> bool:
        parent = node.parent
        return parent is not None and parent.children.get(node.key[: self.block_size]) is node

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks from unlocked leaves, least recently used first."""
        heap = self._lru
        freed = 0
        while heap and freed < num_blocks:
            stamp, _, leaf = heapq.heappop(heap)
            if leaf.lock or leaf.children or not self._in_tree(leaf):
                continue  # stale: it is pushed again if it becomes evictable
            if stamp != leaf.last_access:  # used since it was pushed: back in at its new place
                heapq.heappush(heap, (leaf.last_access, next(self._lru_seq), leaf))
                continue
            need = num_blocks - freed
            if len(leaf.blocks) > need:
                # Evict only the tail of a long leaf.
                self._split(leaf, len(leaf.blocks) - need)  # `leaf` keeps the tail
            parent = leaf.parent
            assert parent is not None, "_leaves() yields no roots"
            del parent.children[leaf.key[: self.block_size]]
            self.pool.free(leaf.blocks)
            freed += len(leaf.blocks)
            self.num_unlocked_blocks -= len(leaf.blocks)
            self.num_cached_blocks -= len(leaf.blocks)
            if parent.is_root:
                self._drop_if_empty(parent)
            elif not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, next(self._lru_seq), parent))
        if freed:
            self.version += 1
        return freed

    def block_hashes(self, limit: int) -> list[int]:
        """Hashes (`prefix_block_hashes`) of up to `limit` cached blocks, shallowest first (the
        prefixes most requests share): a summary of this cache a dispatcher elsewhere can match."""
        bs = self.block_size
        out: list[int] = []
        queue = deque((c, _salt_seed(salt)) for salt, r in self.roots.items() for c in r.children.values())
        while queue and len(out) < limit:
            node, h = queue.popleft()
            for b in range(len(node.blocks)):
                h = hash((h, node.key[b * bs : (b + 1) * bs]))
                out.append(h)
            queue.extend((c, h) for c in node.children.values())
        return out[:limit]

    def _leaves(self) -> list[Node]:
        out = []
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def check_invariants(self) -> None:
        """Raise if counts, locks or ownership disagree (used by tests)."""
        unlocked = cached = 0
        seen: set[int] = set()
        for salt, root in self.roots.items():
            if root.salt != salt or not root.is_root or root.blocks:
                raise AssertionError(f"prefix-cache root of salt {salt!r} is not a root of that salt")
            if not root.children and root.lock == 0:
                raise AssertionError(f"empty prefix-cache root of salt {salt!r} kept with no request holding it")
            if root.lock < sum(c.lock for c in root.children.values()):
                raise AssertionError("a root is locked less than its children together")
        stack: list[tuple[Node, Node]] = [(c, r) for r in self.roots.values() for c in r.children.values()]
        while stack:
            n, parent = stack.pop()
            if n.parent is not parent:
                raise AssertionError("prefix-cache node with a wrong parent link")
            if len(n.key) != len(n.blocks) * self.block_size or not n.blocks:
                raise AssertionError("prefix-cache node key and blocks disagree")
            if n.end != parent.end + len(n.key):
                raise AssertionError("prefix-cache node end offset is wrong")
            if n.lock < 0:
                raise AssertionError("negative prefix-cache lock")
            child_locks = sum(c.lock for c in n.children.values())
            if n.lock < child_locks:
                raise AssertionError("a node is locked less than its children together")
            for b in n.blocks:
                if b in seen:
                    raise AssertionError(f"KV block {b} owned twice by the prefix cache")
                seen.add(b)
                if self.pool.refcount(b) < 1:
                    raise AssertionError(f"prefix cache owns free KV block {b}")
            cached += len(n.blocks)
            if n.lock == 0:
                unlocked += len(n.blocks)
            stack.extend((c, n) for c in n.children.values())
        if cached != self.num_cached_blocks or unlocked != self.num_unlocked_blocks:
            raise AssertionError(
                f"prefix-cache counters drifted: cached {self.num_cached_blocks} vs {cached}, "
                f"unlocked {self.num_unlocked_blocks} vs {unlocked}"
            )
