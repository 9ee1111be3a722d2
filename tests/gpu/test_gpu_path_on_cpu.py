"""The GPU path's code run on a CPU: what a CUDA engine does differently, checked where CI runs.

- `load_format="dummy"`: random weights of config.json's shape, no weight file, seeded.
- The GPU path (the `triton` backend, plain torch linear layers) never builds or calls Tandem's
  C++ CPU kernels, nor packs weights for oneDNN.
- Decode batches padded to the captured sizes through static buffers (what CUDA graphs replay),
  with batches that shrink step by step, token for token against transformers.
- The KV cache sized from memory figures through the runner's profiling pass (a fake probe in
  place of torch.cuda's).
"""

from __future__ import annotations

import json
import os
import shutil

import hf_reference
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, ModelConfig
from tandem.worker.device import GRAPHS_PADDED, resolve_device_plan
from tandem.worker.gpu_memory import graph_reserve
from tandem.worker.model_runner import ModelRunner

pytest.importorskip("triton")

DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
# On a GPU each engine takes a small cache (not 90% of the GPU): several live in one test process.
GPU_KV = {"kv_cache_memory": 64 << 20} if DEVICE == "cuda" else {}
GiB = 1 << 30


@pytest.fixture(scope="module")
def config_only(model_factory, tmp_path_factory):
    """A folder with the tiny Llama's config.json and tokenizer, and no weights."""
    src = model_factory("llama")
    out = tmp_path_factory.mktemp("config-only")
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]


def test_dummy_weights_need_no_file_have_the_configs_shapes_and_follow_the_seed(config_only):
    assert not list(config_only.glob("*.safetensors"))
    cfg = json.loads((config_only / "config.json").read_text())
    gpu_path = dict(load_format="dummy", attention_backend="triton", num_kv_blocks=32, device=DEVICE)
    a = LLM(str(config_only), seed=3, **gpu_path)
    params = dict(a.engine.core.runner.model.named_parameters())
    assert params["embed_tokens.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert params["layers.0.mlp.down_proj.weight"].shape == (cfg["hidden_size"], cfg["intermediate_size"])
    assert len({n.split(".")[1] for n in params if n.startswith("layers.")}) == cfg["num_hidden_layers"]
    assert params["norm.weight"].eq(1).all()
    assert 0.015 < float(params["embed_tokens.weight"].float().std()) < 0.025
    got = _generate(a, PROMPTS)
    assert [len(t) for t in got] == [6, 6, 6]
    assert _generate(LLM(str(config_only), seed=3, **gpu_path), PROMPTS) == got
    assert _generate(LLM(str(config_only), seed=4, **gpu_path), PROMPTS) != got
    # The CPU path takes dummy weights too (packed for oneDNN like a checkpoint's).
    cpu = LLM(str(config_only), load_format="dummy", seed=3, num_kv_blocks=32, device="cpu")
    assert [len(t) for t in _generate(cpu, PROMPTS)] == [6, 6, 6]


def test_without_dummy_a_folder_without_weights_is_refused(config_only):
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(config_only), num_kv_blocks=32, device=DEVICE)


def test_dummy_refuses_a_quantized_config(config_only, tmp_path):
    for f in config_only.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="load_format='dummy' makes float weights"):
        LLM(str(tmp_path), load_format="dummy", num_kv_blocks=32)


def test_the_gpu_path_never_touches_the_cpu_kernels(config_only, monkeypatch):
    import tandem.kernels
    from tandem.model.linear import PackedLinear

    def refuse(*args, **kwargs):
        raise AssertionError("the GPU path asked for Tandem's CPU kernels")

    monkeypatch.setattr(tandem.kernels, "has", refuse)
    monkeypatch.setattr(tandem.kernels, "load", refuse)
    llm = LLM(
        str(config_only), load_format="dummy", attention_backend="triton", num_kv_blocks=32, dtype="bfloat16"
    )
    runner = llm.engine.core.runner
    assert not runner.plan.cpu_kernels
    modules = list(runner.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in modules)
    assert all(isinstance(m, torch.nn.Linear) for m in modules if "Linear" in type(m).__name__)
    assert len(_generate(llm, PROMPTS)) == 3


def test_padded_decode_batches_match_transformers_as_they_shrink(model_factory):
    """Three requests ending after 3, 5 and 8 tokens: decode batches of 3 (padded to 4), 2 and 1,
    through the static buffers, each request's tokens equal to transformers' alone."""
    model_dir = model_factory("llama")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]
    lengths = [3, 5, 8]
    expected = hf_reference.hf_greedy(model_dir, prompts, max(lengths))
    llm = LLM(
        str(model_dir), attention_backend="triton", dtype="float32", max_num_seqs=6, device=DEVICE, **GPU_KV
    )
    graphs = llm.engine.core.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, n, (ref, _) in zip(outs, lengths, expected):
        assert out.outputs[0].token_ids == ref[:n]
    # Every decode step after the prompts' went through the buffers: 2 + 2 + 3 steps of 3, 2, 1.
    assert graphs.steps == max(lengths) - 1
    # The padding rows wrote only their own block, past the KV manager's.
    assert llm.engine.core.runner.kv_caches[0].shape[1] == llm.engine.num_blocks + 1


class FakeProbe:
    """GPU memory figures as torch.cuda would give them: the model's weights appear as allocated
    after loading, the profiling pass raises the peak by `peak`, and `non_torch` bytes appear
    outside torch's allocator."""

    def __init__(self, total: int, free: int, weights: int, peak: int, non_torch: int) -> None:
        self.total, self.free0, self.weights, self.peak, self.non_torch = (
            total,
            free,
            weights,
            peak,
            non_torch,
        )
        self.loaded = False
        self.calls: list[str] = []

    def free_and_total(self) -> tuple[int, int]:
        self.calls.append("free")
        used = self.total - self.free0 + (self.weights + self.non_torch if self.loaded else 0)
        return self.total - used, self.total

    def allocated(self) -> int:
        self.calls.append("allocated")
        # The first call is before loading; every later one after it.
        value = self.weights if self.loaded else 0
        self.loaded = True
        return value

    def reserved(self) -> int:
        return self.weights

    def reset_peak(self) -> None:
        self.calls.append("reset")

    def peak_allocated(self) -> int:
        self.calls.append("peak")
        return self.weights + self.peak


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_kv_cache_is_sized_from_memory_figures(model_factory, backend):
    mc = ModelConfig.from_pretrained(model_factory("llama"))
    config = EngineConfig(
        model=mc.path,
        attention_backend=backend,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        gpu_memory_utilization=0.5,
    )
    plan = resolve_device_plan(config, has_cuda=False)
    probe = FakeProbe(total=GiB, free=GiB - (10 << 20), weights=100 << 20, peak=30 << 20, non_torch=20 << 20)
    runner = ModelRunner(mc, config, None, 128, plan=plan, memory_probe=probe)
    assert probe.calls.index("reset") < probe.calls.index("peak")  # the profiling pass ran between
    per_block = ModelRunner.kv_bytes_per_block(mc, config.block_size, runner.kv_format)
    graphs = plan.decode_graphs == GRAPHS_PADDED
    budget = runner.kv_budget
    assert budget is not None
    # The peak less the profiling pass's own scratch KV cache (a few blocks of this tiny model).
    scratch = (30 << 20) - budget.activation_peak_bytes
    assert 0 < scratch <= -(-32 // config.block_size) * 4 * per_block
    logits = 4 * mc.vocab_size * runner.dtype.itemsize
    reserve = graph_reserve(budget.activation_peak_bytes, 4, 32, logits) if graphs else 0
    left = GiB // 2 - (100 << 20) - budget.activation_peak_bytes - (20 << 20) - reserve
    assert budget.num_blocks == left // per_block
    assert runner.num_blocks == left // per_block - (1 if graphs else 0)
    assert runner.kv_caches[0].shape[1] == left // per_block


def test_kv_sizing_refuses_a_gpu_other_processes_hold(model_factory):
    mc = ModelConfig.from_pretrained(model_factory("llama"))
    config = EngineConfig(model=mc.path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    probe = FakeProbe(total=GiB, free=GiB // 2, weights=1 << 20, peak=1 << 20, non_torch=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9 asks for"):
        ModelRunner(
            mc, config, None, 128, plan=resolve_device_plan(config, has_cuda=False), memory_probe=probe
        )


def test_a_failed_capture_leaves_an_eager_engine(config_only, monkeypatch):
    from tandem.worker.cuda_graphs import DecodeGraphs

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", fail)
    gpu_path = dict(load_format="dummy", attention_backend="triton", num_kv_blocks=32, device=DEVICE)
    llm = LLM(str(config_only), **gpu_path)
    runner = llm.engine.core.runner
    assert runner.graphs is None and "not permitted" in (runner.graph_error or "")
    monkeypatch.undo()
    assert _generate(llm, PROMPTS) == _generate(
        LLM(str(config_only), enforce_eager=True, **gpu_path), PROMPTS
    )
