"""The GPU path's choices as pure functions: which device, backend, linear path and decode-graph
mode an engine's arguments give on a machine with or without a GPU (tandem/worker/device.py), the
KV cache's size from GPU memory figures (tandem/worker/gpu_memory.py), and the decode graphs'
ladder, padding and step selection (tandem/worker/cuda_graphs.py)."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.core.request import Request
from tandem.sampling_params import SamplingParams
from tandem.worker.cuda_graphs import capture_sizes, graph_step, padded_size
from tandem.worker.device import GRAPHS_CAPTURE, GRAPHS_OFF, GRAPHS_PADDED, resolve_device_plan
from tandem.worker.gpu_memory import graph_reserve, size_kv_cache

GiB = 1 << 30


def plan(has_cuda: bool, has_flashinfer: bool = False, graph_safe: bool = True, **kw):
    return resolve_device_plan(EngineConfig(model="unused", **kw), has_cuda, has_flashinfer, graph_safe)


def test_auto_takes_the_gpu_where_there_is_one():
    gpu = plan(True)
    assert (gpu.device, gpu.attention_backend, gpu.cpu_kernels, gpu.decode_graphs) == (
        "cuda",
        "triton",
        False,
        GRAPHS_CAPTURE,
    )
    cpu = plan(False)
    assert (cpu.device, cpu.attention_backend, cpu.cpu_kernels, cpu.decode_graphs) == (
        "cpu",
        "torch",
        True,
        GRAPHS_OFF,
    )
    assert "no CUDA GPU" in cpu.reason and "a CUDA GPU is visible" in gpu.reason


def test_cuda_without_a_gpu_names_the_field():
    with pytest.raises(ValueError, match=r"device='cuda' \(--device cuda\)"):
        plan(False, device="cuda")
    assert plan(True, device="cpu").device == "cpu"


def test_the_triton_backend_on_a_cpu_is_the_gpu_paths_code():
    p = plan(False, attention_backend="triton")
    assert (p.device, p.cpu_kernels, p.decode_graphs) == ("cpu", False, GRAPHS_PADDED)
    assert plan(False, attention_backend="triton", enforce_eager=True).decode_graphs == GRAPHS_OFF


def test_graphs_off_with_enforce_eager_a_model_that_syncs_or_another_backend():
    assert plan(True, enforce_eager=True).decode_graphs == GRAPHS_OFF
    assert plan(True, graph_safe=False).decode_graphs == GRAPHS_OFF
    torch_on_gpu = plan(True, attention_backend="torch")
    assert (torch_on_gpu.cpu_kernels, torch_on_gpu.decode_graphs) == (False, GRAPHS_OFF)


def test_flashinfer_only_where_importable_and_on_cuda():
    with pytest.raises(ValueError, match="needs the flashinfer package"):
        plan(True, has_flashinfer=False, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="CUDA only"):
        plan(False, has_flashinfer=True, attention_backend="flashinfer")
    assert plan(True, has_flashinfer=True, attention_backend="flashinfer").attention_backend == "flashinfer"


def test_cpu_only_quantization_is_refused_on_cuda():
    with pytest.raises(ValueError, match="quantization='int8'"):
        plan(True, quantization="int8")
    assert plan(False, quantization="int8").cpu_kernels


@pytest.mark.parametrize(
    "field, value",
    [
        ("device", "tpu"),
        ("attention_backend", "xformers"),
        ("load_format", "pt"),
        ("gpu_memory_utilization", 1.5),
        ("gpu_memory_utilization", 0.0),
        ("enforce_eager", "yes"),
        ("kv_cache_memory", 0),
    ],
)
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="unused", **{field: value})


# -- the KV cache's size -------------------------------------------------------


def test_kv_gets_what_utilization_leaves():
    b = size_kv_cache(
        total_bytes=100 * GiB,
        free_at_start_bytes=99 * GiB,
        utilization=0.9,
        weights_bytes=16 * GiB,
        activation_peak_bytes=2 * GiB,
        non_torch_bytes=1 * GiB,
        graph_reserve_bytes=1 * GiB,
        block_bytes=2 * 1024 * 1024,
    )
    left = int(100 * GiB * 0.9) - 20 * GiB
    assert b.num_blocks == left // (2 * 1024 * 1024)
    assert b.kv_bytes == b.num_blocks * b.block_bytes <= left
    line = b.describe(16)
    assert f"{b.num_blocks} blocks ({b.num_blocks * 16} tokens" in line and "0.9 x 100.00 GiB" in line


def test_kv_sizing_errors_name_gpu_memory_utilization():
    common = dict(
        total_bytes=80 * GiB,
        weights_bytes=16 * GiB,
        activation_peak_bytes=GiB,
        non_torch_bytes=0,
        block_bytes=1 << 20,
    )
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=0.9 asks for 72.00 GiB.*only 40.00 GiB were free"
    ):
        size_kv_cache(free_at_start_bytes=40 * GiB, utilization=0.9, **common)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.2 leaves no room"):
        size_kv_cache(free_at_start_bytes=80 * GiB, utilization=0.2, **common)
    # Raising the fraction makes room.
    assert (
        size_kv_cache(free_at_start_bytes=80 * GiB, utilization=0.5, **common).num_blocks == (23 * GiB) >> 20
    )


def test_graph_reserve_scales_with_the_largest_captured_batch():
    assert graph_reserve(GiB, 0, 512) == 0
    assert graph_reserve(GiB, 256, 512) == GiB // 2 + (64 << 20)
    assert graph_reserve(GiB, 1024, 512) == GiB + (64 << 20)
    assert graph_reserve(GiB, 256, 512, logits_bytes=256 * 1000 * 2) == GiB // 2 + 512_000 + (64 << 20)


# -- decode graphs: ladder, padding, which steps --------------------------------


def test_the_capture_ladder():
    assert capture_sizes(256, 8192) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(20, 8192) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256, 12) == [1, 2, 4, 8, 12]  # never past the token budget
    assert capture_sizes(3, 512) == [1, 2, 3]
    assert capture_sizes(1, 512) == [1]


@pytest.mark.parametrize(
    "n, size", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 20), (20, 20), (21, None), (0, None)]
)
def test_a_batch_pads_to_the_next_captured_size(n, size):
    assert padded_size(n, [1, 2, 4, 8, 16, 20]) == size


def _decoding(n_prompt: int = 5, n_out: int = 2) -> Request:
    r = Request("r", list(range(n_prompt)), SamplingParams(), max_tokens=8)
    r.token_ids += [7] * n_out
    r.num_computed_tokens = r.num_tokens - 1
    r.block_ids = [0]
    return r


def test_only_plain_decode_steps_take_a_graph():
    r = _decoding()
    assert graph_step([r], [1], has_drafts=False, max_size=4)
    assert not graph_step([r], [1], has_drafts=True, max_size=4)
    assert not graph_step([r] * 5, [1] * 5, has_drafts=False, max_size=4)
    assert not graph_step([], [], has_drafts=False, max_size=4)
    chunk = _decoding()
    chunk.num_computed_tokens = 2  # a prompt chunk, or a token that is not the last
    assert not graph_step([r, chunk], [1, 1], has_drafts=False, max_size=4)
    assert not graph_step([r], [2], has_drafts=False, max_size=4)
    forking = _decoding()
    forking.pending_children = [_decoding()]
    assert not graph_step([forking], [1], has_drafts=False, max_size=4)
