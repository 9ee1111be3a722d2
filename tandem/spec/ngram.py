"""N-gram (prompt lookup) proposals: copy what followed the latest earlier occurrence of the context's tail.

Vectorized with numpy: the candidates are the positions holding the last token; each further step keeps
those whose preceding token also matches the tail, so the work is one comparison over the sequence plus
`max_n - 1` shrinking gathers, whatever `k` and the sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup decoding: for n from max_n down to min_n, find the most recent earlier occurrence
    of the last n tokens of token_ids (not the suffix itself) and return up to k tokens that followed
    that occurrence (fewer if the sequence ends; [] if no match or k == 0).

    Occurrences may overlap the suffix (in `a b a b a b` the tail `a b` last occurred at index 2, so the
    proposal is `a b`). `token_ids` may be a list or a 1-D integer numpy array."""
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n, got max_n={max_n}, min_n={min_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if isinstance(token_ids, np.ndarray):
        a = token_ids
        if a.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {a.shape}")
    else:
        # About twice as fast as np.asarray on a list of Python ints (the dominant cost on long lists;
        # a caller holding a numpy array of the sequence skips it).
        a = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    length = a.shape[0]
    if k == 0 or length < min_n + 1:
        return []
    # `ends` holds the end index j (inclusive) of every earlier window a[j-n+1 : j+1] equal to the last n
    # tokens, for the current n; j <= length - 2 excludes the suffix itself.
    ends = np.flatnonzero(a[: length - 1] == a[length - 1])
    best_n, best_end = 0, -1
    n = 1
    while ends.size:
        if n >= min_n:
            best_n, best_end = n, int(ends[-1])  # ends is ascending: the last one is the most recent
        if n == max_n:
            break
        ends = ends[ends >= n]  # the window must fit: start j - n >= 0
        ends = ends[a[ends - n] == a[length - 1 - n]]
        n += 1
    if best_n == 0:
        return []
    return a[best_end + 1 : best_end + 1 + k].tolist()
