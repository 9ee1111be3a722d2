"""Draft trees: their structure (depths, ancestor masks, paths), greedy verification, and recursive
rejection sampling over several branches, whose emitted tokens follow the target exactly (a
chi-square test over many draws, with the drafts chosen to be likely, unlikely or impossible),
while a sampler that forgets to take a rejected child out of p fails the same test."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from tandem.core.draft_tree import DraftTree, verify_greedy
from tandem.spec import rejection
from tandem.spec.rejection import verify_tree_sampled

# Root -> nodes 0 ("a"), 1 ("b"), 2 ("c"); node 0 -> 3 ("d"), 4 ("e"); node 3 -> 5.
TREE = DraftTree(tokens=(0, 1, 2, 3, 4, 1), parents=(-1, -1, -1, 0, 0, 3))


def test_structure():
    assert TREE.depths() == [1, 1, 1, 2, 2, 3]
    assert TREE.children(-1) == [0, 1, 2] and TREE.children(0) == [3, 4] and TREE.children(5) == []
    assert TREE.path(5) == [0, 3, 5]
    bits = TREE.ancestor_bits()
    # Query token j + 1 is node j; the root is query token 0.
    assert bits[0] == 0b1
    assert bits[1] == 0b11 and bits[4] == 0b10011 and bits[6] == 0b1010011
    assert not TREE.is_chain and DraftTree.chain([7, 8, 9]).is_chain
    assert DraftTree.chain([7, 8]).ancestor_bits() == [1, 3, 7]
    with pytest.raises(ValueError, match="parents must come before children"):
        DraftTree((1, 2), (1, -1))


def test_greedy_walks_the_matching_branch():
    # After the root the target wants 0 (node 0), then 3 (node 3), then 2: node 5 holds 1, so stop.
    target = [0, 3, 9, 9, 2, 9, 9]
    assert verify_greedy(TREE, target) == ([0, 3], 2)
    assert verify_greedy(TREE, [1, 0, 0, 0, 0, 0, 0]) == ([1], 0)
    assert verify_greedy(TREE, [4, 0, 0, 0, 0, 0, 0]) == ([], 4)


VOCAB = 5
P = torch.tensor(
    [
        [0.30, 0.05, 0.0, 0.45, 0.20],  # after the root: "c" (2) impossible, "b" (1) unlikely
        [0.10, 0.20, 0.30, 0.25, 0.15],  # after node 0
        [0.2] * 5,
        [0.2] * 5,
        [0.5, 0.5, 0.0, 0.0, 0.0],  # after node 3
        [0.2] * 5,
        [0.2] * 5,
    ]
)


def first_two(draws: int, seed: int = 0) -> tuple[Counter, Counter]:
    """The first emitted token, and the second given that the first was node 0's token."""
    gen = torch.Generator().manual_seed(seed)
    first, second = Counter(), Counter()
    for _ in range(draws):
        accepted, extra = verify_tree_sampled(TREE, P, gen)
        emitted = [TREE.tokens[n] for n in accepted] + [extra]
        first[emitted[0]] += 1
        if emitted[0] == 0:
            second[emitted[1]] += 1
    return first, second


def p_value(counts: Counter, p: torch.Tensor) -> float:
    total = sum(counts.values())
    support = [t for t in range(VOCAB) if p[t] > 0]
    assert all(counts[t] == 0 for t in range(VOCAB) if p[t] == 0)
    mass = sum(float(p[t]) for t in support)
    return chisquare([counts[t] for t in support], [total * float(p[t]) / mass for t in support]).pvalue


def test_multi_branch_sampling_follows_the_target():
    first, second = first_two(20_000)
    assert p_value(first, P[0]) > 1e-3
    assert p_value(second, P[1]) > 1e-3


def test_the_check_has_power(monkeypatch):
    """A sampler that, after rejecting a child, still draws it again from an unchanged p."""

    def keep_rejected(tree, probs, generator):
        node, accepted = -1, []
        while True:
            p = probs[node + 1].double()
            for child in tree.children(node):
                if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(
                    p[tree.tokens[child]]
                ):
                    accepted.append(child)
                    node = child
                    break
            else:
                noise = torch.empty_like(p).exponential_(generator=generator)
                return accepted, int((p / noise).argmax())

    monkeypatch.setattr(rejection, "verify_tree_sampled", keep_rejected)
    gen = torch.Generator().manual_seed(0)
    first = Counter()
    for _ in range(20_000):
        accepted, extra = rejection.verify_tree_sampled(TREE, P, gen)
        first[([TREE.tokens[n] for n in accepted] + [extra])[0]] += 1
    assert p_value(first, P[0]) < 1e-8
