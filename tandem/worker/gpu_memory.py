"""The KV cache's size on a GPU, from `gpu_memory_utilization` (vLLM's meaning).

The engine may use `utilization` of the GPU's total memory. Out of that come, in order: the
weights (measured after loading), the peak of the activations (measured by a profiling pass at
the largest step the scheduler can make: `max_num_batched_tokens` tokens, and sampling over
`max_num_seqs` rows with top-k/top-p), memory outside torch's allocator that appeared since start
(the CUDA context's growth, cuBLAS workspaces, Triton's modules), and a reserve for the CUDA
graphs' own memory pool. What is left is KV blocks. `size_kv_cache` is that arithmetic alone, on
figures passed in, so it is tested with any figures; `MemoryProbe` is where the figures come from
(torch.cuda on a GPU, a fake in tests).

As in vLLM, memory other processes hold is not ours to take: if less than `utilization` of the
total is free at start, that is an error, not a smaller cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

GiB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class KVBudget:
    total_bytes: int
    utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    graph_reserve_bytes: int
    kv_bytes: int
    block_bytes: int
    num_blocks: int

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    def describe(self, block_size: int) -> str:
        """The start-up line."""
        return (
            f"KV cache: {self.num_blocks} blocks ({self.num_blocks * block_size} tokens, "
            f"{self.kv_bytes / GiB:.2f} GiB) = {self.utilization:g} x {self.total_bytes / GiB:.2f} GiB "
            f"- weights {self.weights_bytes / GiB:.2f} GiB - activation peak "
            f"{self.activation_peak_bytes / GiB:.2f} GiB - non-torch {self.non_torch_bytes / GiB:.2f} GiB "
            f"- CUDA graphs reserve {self.graph_reserve_bytes / GiB:.2f} GiB"
        )


def size_kv_cache(
    *,
    total_bytes: int,
    free_at_start_bytes: int,
    utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    non_torch_bytes: int,
    block_bytes: int,
    graph_reserve_bytes: int = 0,
) -> KVBudget:
    """How many KV blocks of `block_bytes` fit; ValueError (naming gpu_memory_utilization) when
    the GPU is short at start or nothing is left for one block."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if block_bytes < 1:
        raise ValueError(f"a KV block must take at least one byte, got {block_bytes}")
    budget = int(total_bytes * utilization)
    if free_at_start_bytes < budget:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} asks for {budget / GiB:.2f} GiB of the GPU's "
            f"{total_bytes / GiB:.2f} GiB, but only {free_at_start_bytes / GiB:.2f} GiB were free at start "
            "(other processes hold the rest): lower gpu_memory_utilization or free the GPU"
        )
    kv = budget - weights_bytes - activation_peak_bytes - non_torch_bytes - graph_reserve_bytes
    num_blocks = max(0, kv) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} leaves no room for the KV cache: of "
            f"{budget / GiB:.2f} GiB, the weights take {weights_bytes / GiB:.2f} GiB, the activation "
            f"peak {activation_peak_bytes / GiB:.2f} GiB, non-torch memory {non_torch_bytes / GiB:.2f} GiB "
            f"and the CUDA graphs' reserve {graph_reserve_bytes / GiB:.2f} GiB; one block needs "
            f"{block_bytes} bytes (raise gpu_memory_utilization, or lower max_num_batched_tokens)"
        )
    return KVBudget(
        total_bytes=total_bytes,
        utilization=utilization,
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes,
        non_torch_bytes=non_torch_bytes,
        graph_reserve_bytes=graph_reserve_bytes,
        kv_bytes=num_blocks * block_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
    )


def graph_reserve(
    activation_peak_bytes: int, graph_rows: int, profile_rows: int, logits_bytes: int = 0
) -> int:
    """Memory set aside for the CUDA graphs' private pool (allocated after the KV cache): the
    captured decode batches' activations, estimated as the profiled peak scaled from the profile's
    rows to the largest captured batch's, the graphs' shared logits buffer (`logits_bytes`), and
    64 MiB for the graphs themselves. 0 without graphs."""
    if graph_rows <= 0:
        return 0
    scaled = activation_peak_bytes * min(1.0, graph_rows / max(1, profile_rows))
    return int(scaled) + logits_bytes + (64 << 20)


class MemoryProbe(Protocol):
    """Where the figures come from (torch.cuda on a GPU)."""

    def free_and_total(self) -> tuple[int, int]: ...

    def allocated(self) -> int: ...

    def reserved(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak_allocated(self) -> int: ...


class CudaMemoryProbe:
    def __init__(self, device: torch.device) -> None:
        import torch

        self.torch = torch
        self.device = device

    def free_and_total(self) -> tuple[int, int]:
        self.torch.cuda.synchronize(self.device)
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def allocated(self) -> int:
        return int(self.torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        self.torch.cuda.synchronize(self.device)
        return int(self.torch.cuda.max_memory_allocated(self.device))
