"""Grammar-constrained rows: the hook the runner asks for a step's token bitmask, and the one op
that applies it to the logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tandem.core.request import Request

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarHook(Protocol):
    """What the runner needs of the engine's structured-output state (tandem.structured.manager)."""

    def token_bitmask(self, rows: Sequence[tuple[Request, list[int]]]) -> tuple[list[int], np.ndarray] | None:
        """For logits rows given as (request, draft tokens before the row): the constrained rows'
        indices and their allowed tokens as int32 bitmask words `[len(rows), ceil(V / 32)]`;
        None when no row is constrained."""
        ...


def token_mask(rows: list[int], bitmask: np.ndarray, num_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The `[num_rows, vocab]` bool mask of forbidden tokens (False on unconstrained rows)."""
    words = torch.from_numpy(bitmask).to(device)
    allowed = ((words[:, :, None] >> _BITS.to(device)) & 1).bool().view(len(rows), -1)[:, :vocab]
    if len(rows) == num_rows:
        return ~allowed
    forbidden = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    forbidden[torch.tensor(rows, device=device)] = ~allowed
    return forbidden
