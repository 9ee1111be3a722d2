"""N-gram (prompt lookup) proposals: the numpy search against a plain-Python reference, and its preferences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.spec.ngram import propose_ngram


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The docstring, literally: longest n first, then the latest start i < len - n whose window is the tail."""
    if k == 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        tail = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    k=st.integers(0, 7),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 4),
)
def test_matches_reference(tokens, k, min_n, extra_n):
    max_n = min_n + extra_n
    got = propose_ngram(tokens, k, min_n, max_n)
    assert got == reference(tokens, k, min_n, max_n)
    assert all(type(t) is int for t in got)
    assert propose_ngram(np.array(tokens, dtype=np.int64), k, min_n, max_n) == got


def test_long_random_sequences_match_reference():
    rng = np.random.default_rng(0)
    for vocab in (2, 5, 50):
        tokens = rng.integers(0, vocab, size=3000).tolist()
        for min_n, max_n in ((1, 1), (1, 4), (2, 6), (3, 3)):
            assert propose_ngram(tokens, 5, min_n, max_n) == reference(tokens, 5, min_n, max_n)


def test_prefers_most_recent_occurrence():
    #        0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert propose_ngram(tokens, 2, 2, 2) == [20, 21]
    assert propose_ngram(tokens, 2, 1, 1) == [20, 21]


def test_prefers_longer_ngram_over_more_recent():
    # The tail 3 1 2 occurs early (followed by 7 8); 1 2 alone occurs later (followed by 9 9).
    tokens = [3, 1, 2, 7, 8, 5, 1, 2, 9, 9, 3, 1, 2]
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]
    assert propose_ngram(tokens, 2, 1, 2) == [9, 9]
    # min_n above every match length: nothing.
    assert propose_ngram(tokens, 2, 4, 5) == []


def test_truncates_at_sequence_end_and_allows_overlap():
    # The latest earlier `1 2` starts at index 2 and overlaps the tail; only 2 tokens follow it.
    assert propose_ngram([1, 2, 1, 2, 1, 2], 5, 2, 2) == [1, 2]
    assert propose_ngram([4, 4, 4, 4], 10, 1, 3) == [4]  # `4 4 4` at index 0, then one token
    assert propose_ngram([5, 6, 7, 5], 10, 1, 1) == [6, 7, 5]
    assert propose_ngram([5, 6, 7, 5], 2, 1, 1) == [6, 7]


def test_no_match_and_degenerate_inputs():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([], 3, 1, 3) == []
    assert propose_ngram([7], 3, 1, 3) == []
    assert propose_ngram([7, 7], 0, 1, 3) == []
    assert propose_ngram([7, 7], 3, 2, 3) == []  # the only 2-gram is the tail itself


@pytest.mark.parametrize(
    "k, min_n, max_n",
    [(1, 0, 2), (1, -1, 2), (1, 3, 2), (-1, 1, 2)],
)
def test_rejects_bad_arguments(k, min_n, max_n):
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1, 2], k, min_n, max_n)
