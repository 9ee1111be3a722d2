"""Where the engine runs and what that decides: the device, the attention backend, the linear
layers' path, CUDA graphs. One pure function of the engine's arguments and two facts about the
machine (is a CUDA GPU visible, is FlashInfer importable), so every choice is tested without a GPU.

On a CPU with the `torch` backend the engine takes Tandem's CPU paths (oneDNN-packed linear layers,
the C++ kernels in tandem/kernels, weights on huge pages). Everything else is the GPU path's code:
plain `torch.nn.functional.linear` layers and PyTorch's operators for norms, activations and
rotary; the Triton (or FlashInfer) attention; decode batches padded to the captured sizes and run
through static buffers. On CUDA those buffers are replayed as CUDA graphs; on a CPU with the
`triton` backend (its kernel under the Triton interpreter) the same padded batches run eagerly, so
the test suite runs the GPU path's logic end to end, token for token against transformers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from tandem.config import QUANTIZATION_METHODS, EngineConfig

# How decode batches run: captured CUDA graphs replayed; the same padded static buffers run
# eagerly (the GPU path on a CPU); or the plain per-step batch.
GRAPHS_CAPTURE, GRAPHS_PADDED, GRAPHS_OFF = "capture", "padded", "off"


@dataclass(frozen=True, slots=True)
class DevicePlan:
    device: str  # "cpu" or "cuda"
    attention_backend: str  # "torch", "triton" or "flashinfer"
    # Tandem's CPU paths (oneDNN packing, the C++ kernels, huge pages); False: plain torch layers.
    cpu_kernels: bool
    decode_graphs: str  # GRAPHS_CAPTURE, GRAPHS_PADDED or GRAPHS_OFF
    # Why "auto" resolved as it did (said at start-up), e.g. "auto: a CUDA GPU is visible".
    reason: str = ""
    # Overlap scheduling: step N+1 is planned and launched before step N's tokens are read back
    # (tandem/core/overlap.py). `async_scheduling` None: on for CUDA, off on a CPU.
    async_scheduling: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_device_plan(
    config: EngineConfig,
    has_cuda: bool | None = None,
    has_flashinfer: bool | None = None,
    graph_safe: bool = True,
) -> DevicePlan:
    """The plan for `config` on a machine that has (or not) a CUDA GPU and FlashInfer (None: ask
    torch and the import system). `graph_safe`: the model's forward can be captured (no host
    synchronisation inside: MoE routing counts tokens per expert on the host, so MoE models run
    eagerly). Raises ValueError naming the engine argument that cannot be honoured."""
    if has_cuda is None:
        has_cuda = cuda_available()
    if config.device == "cuda" and not has_cuda:
        raise ValueError(
            "device='cuda' (--device cuda) but torch sees no CUDA GPU (torch.cuda.is_available() is "
            "False: no GPU, no driver, or a CPU-only torch build); use device 'cpu' or 'auto'"
        )
    if config.device == "auto":
        device = "cuda" if has_cuda else "cpu"
        reason = f"device auto: {'a CUDA GPU is visible' if has_cuda else 'no CUDA GPU is visible'}"
    else:
        device, reason = config.device, f"device {config.device}"
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device == "cuda" else "torch"
    if backend == "flashinfer":
        if has_flashinfer is None:
            has_flashinfer = flashinfer_available()
        if not has_flashinfer:
            raise ValueError(
                "attention_backend='flashinfer' (--attention-backend flashinfer) needs the flashinfer "
                "package, which is not installed; 'triton' (the default on CUDA) needs nothing more"
            )
        if device != "cuda":
            raise ValueError("attention_backend='flashinfer' runs on CUDA only (device is 'cpu')")
    if device == "cuda" and (config.quantization in QUANTIZATION_METHODS or config.quantization == "gguf"):
        raise ValueError(
            f"quantization={config.quantization!r} runs on Tandem's CPU kernels only; on CUDA the weights run "
            "in bfloat16 or float16 (an fp8 checkpoint runs torch._scaled_mm from compute capability 8.9, "
            "else is widened at load; 4-bit ones are not taken)"
        )
    cpu_kernels = device == "cpu" and backend == "torch"
    if config.enforce_eager or not graph_safe or backend != "triton":
        graphs = GRAPHS_OFF
    else:
        graphs = GRAPHS_CAPTURE if device == "cuda" else GRAPHS_PADDED
    overlap = device == "cuda" if config.async_scheduling is None else config.async_scheduling
    return DevicePlan(device, backend, cpu_kernels, graphs, reason, overlap)
