"""Draft trees and their verification.

A `DraftTree` is a request's drafts for one step as a tree under the last verified token (the
root): node i holds `tokens[i]` and hangs under `parents[i]` (-1: the root), parents before
children. The target verifies every node in one pass: the request's query tokens are the root
then the nodes in order, each at position `root + depth`, each seeing its ancestors and itself
(`ancestor_bits`). A chain is the tree whose node i hangs under node i - 1.

Verification walks down from the root. Greedy (`verify_greedy`): the target's argmax at the
current node; the child holding it is accepted and the walk goes on, else that argmax is the
step's last token. Sampling: `tandem.spec.rejection.verify_tree_sampled` (torch, worker side).
Plain data and pure Python: the scheduler plans with it, the runner verifies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs one parent per token")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree node {i} hangs under {p}: parents must come before children")

    @staticmethod
    def chain(tokens: Sequence[int]) -> DraftTree:
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, k: int) -> DraftTree:
        """The first k nodes: a tree too, parents coming before their children."""
        return self if len(self) <= k else DraftTree(self.tokens[:k], self.parents[:k])

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth below the root (the root's children: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1: the root), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_bits(self) -> list[int]:
        """For the query tokens (root, then node i as token i + 1): the bits of the query tokens
        each may see, its ancestors and itself."""
        bits = [1]
        for i, p in enumerate(self.parents):
            bits.append(bits[p + 1] | (1 << (i + 1)))
        return bits

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def verify_greedy(tree: DraftTree, target: Sequence[int]) -> tuple[list[int], int]:
    """target[j]: the target's token after query token j (j = 0: the root). Returns the accepted
    nodes (a path from the root) and the token after the last of them."""
    accepted: list[int] = []
    row = 0
    while True:
        want = target[row]
        nxt = next((c for c in tree.children(accepted[-1] if accepted else -1) if tree.tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        row = nxt + 1
