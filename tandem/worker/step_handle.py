"""A step launched ahead of the host (overlap scheduling): what `ModelRunner.launch` returns and
`ModelRunner.collect` reads back, and how the next step finds its placeholder inputs in it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.core.request import Request
from tandem.core.step_io import RunnerOutput


@dataclass(slots=True)
class StepHandle:
    """One launched step. Its sampled tokens stay on the device (the next step's placeholder
    inputs are gathered from them there); their copy to the host is queued behind them, and
    `ready` (CUDA) is recorded after it: `collect` waits on that one event, the step's only read."""

    # [rows] sampled tokens on the device, and their copy in host memory (pinned on CUDA); None
    # when the step sampled nothing (prompt chunks only).
    tokens: torch.Tensor | None
    host: torch.Tensor | None
    ready: torch.cuda.Event | None
    # request id -> its row in `tokens`.
    rows: dict[str, int] = field(default_factory=dict)
    out: RunnerOutput = field(default_factory=RunnerOutput)
    # Rows asking for logprobs: `Sampler.logprob_tensors`' output copied to the host beside the
    # tokens (read after the same event), and each row's count (None: not asked).
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: list[int | None] = field(default_factory=list)


def placeholder_inputs(
    requests: Sequence[Request], num_tokens: Sequence[int], prev: StepHandle | None
) -> tuple[list[int], list[int], list[int]]:
    """The inputs of a step that are placeholders: (request index, offset in its scheduled tokens,
    row of `prev.tokens` holding the real token) each. A placeholder is a request's last token,
    sampled by the step in flight (`prev`)."""
    index: list[int] = []
    offset: list[int] = []
    rows: list[int] = []
    for i, (req, n) in enumerate(zip(requests, num_tokens)):
        if not req.num_placeholders:
            continue
        at = req.num_tokens - 1 - req.num_computed_tokens
        if not 0 <= at < n:
            continue
        row = None if prev is None else prev.rows.get(req.request_id)
        if row is None or prev is None or prev.tokens is None:
            raise RuntimeError(f"request {req.request_id} has a placeholder token no step in flight sampled")
        index.append(i)
        offset.append(at)
        rows.append(row)
    return index, offset, rows
