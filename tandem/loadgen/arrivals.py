"""When the load generator sends each request: the gaps of a gamma arrival process."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


def arrival_intervals(
    rate: float, burstiness: float = 1.0, seed: int = 0, n: int | None = None
) -> Iterator[float]:
    """Gaps between request sends, as vLLM: gamma(shape=burstiness, scale=1/(rate*burstiness)).

    The mean gap is 1/rate whatever the burstiness; burstiness 1 is a Poisson process, lower is
    burstier, higher is more regular. An infinite rate sends everything at once (gaps of 0).
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    rng = np.random.default_rng(seed)
    count = 0
    while n is None or count < n:
        count += 1
        if math.isinf(rate):
            yield 0.0
        else:
            yield float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
