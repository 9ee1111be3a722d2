"""The flat batch a forward pass runs over, and the logits rows sampled from it: built the same way
for the target's steps and the draft model's proposal passes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.request import Request
from tandem.model.forward_batch import ForwardBatch


@dataclass(slots=True)
class SampleRow:
    """One logits row to sample or verify at: its request and the draft tokens before it."""

    request: Request
    history: list[int]  # draft tokens preceding this position (count as output for penalties)


def to_device(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list or numpy array) as a tensor on `device`. To a GPU through pinned memory
    and a non-blocking copy: from pageable memory torch waits for the stream to drain, which would
    stall the host behind the step in flight (overlap scheduling)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def build_batch(
    reqs: list[Request],
    q_lens_l: list[int],
    block_size: int,
    device: torch.device,
    extra_tokens: dict[str, list[int]] | None = None,
    starts_l: list[int] | None = None,
) -> tuple[ForwardBatch, np.ndarray]:
    """The flat batch for `reqs` computing `q_lens_l` tokens each from `num_computed_tokens` on.

    `extra_tokens` are appended after a request's known tokens (draft tokens being verified);
    `starts_l` overrides where each request starts. Returns the batch and each request's end
    offset in it.
    """
    num_reqs = len(reqs)
    q_lens = np.asarray(q_lens_l, dtype=np.int64)
    if starts_l is None:
        starts_l = [r.num_computed_tokens for r in reqs]
    starts = np.asarray(starts_l, dtype=np.int64)
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    input_ids: list[int] = []
    max_blocks = max(len(r.block_ids) for r in reqs)
    tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, req in enumerate(reqs):
        s, n = int(starts[i]), q_lens_l[i]
        extra = extra_tokens.get(req.request_id) if extra_tokens else None
        if extra:
            input_ids.extend(req.token_ids[s : s + n - len(extra)])
            input_ids.extend(extra)
        else:
            input_ids.extend(req.token_ids[s : s + n])
        tables[i, : len(req.block_ids)] = req.block_ids
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    positions = np.arange(int(qsl[-1])) - qsl[:-1][req_of_token] + starts[req_of_token]
    slots = tables[req_of_token, positions // block_size] * block_size + positions % block_size
    batch = ForwardBatch(
        input_ids=to_device(input_ids, torch.long, device),
        positions=to_device(positions, torch.long, device),
        slot_mapping=to_device(slots, torch.long, device),
        logits_indices=torch.empty(0, dtype=torch.long, device=device),
        query_start_loc=qsl,
        query_lens=q_lens,
        seq_lens=starts + q_lens,
        block_tables=tables,
        block_size=block_size,
    )
    return batch, qsl[1:]
