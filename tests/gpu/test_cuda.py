"""On a CUDA GPU only (marked `gpu`, skipped elsewhere): decode batches replayed from captured CUDA
graphs give transformers' tokens, the KV cache is sized from the GPU's memory, weights, KV and
sampling all live on the device, and seeded sampling (speculation's rejection sampling included)
runs there and repeats itself."""

from __future__ import annotations

import gc

import hf_reference
import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.gpu

# Engines in these tests that are not about sizing take a small cache, so several fit at once.
SMALL = dict(kv_cache_memory=64 << 20)


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_decode_graphs_replay_transformers_tokens(model_factory):
    model_dir = model_factory("llama")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]
    lengths = [3, 5, 8]
    expected = hf_reference.hf_greedy(model_dir, prompts, max(lengths))
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=6, **SMALL)
    runner = llm.engine.core.runner
    assert runner.graph_error is None, runner.graph_error
    assert runner.plan.decode_graphs == "capture" and sorted(runner.graphs.graphs) == [1, 2, 4, 6]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, n, (ref, _) in zip(outs, lengths, expected):
        assert out.outputs[0].token_ids == ref[:n]
    assert runner.graphs.steps == max(lengths) - 1
    assert runner.kv_caches[0].is_cuda and next(runner.model.parameters()).is_cuda


def test_graphs_and_eager_agree(model_factory):
    model_dir = model_factory("qwen3", head_dim=32)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17, 30, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    runs = []
    for eager in (False, True):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", enforce_eager=eager, **SMALL)
        assert (llm.engine.core.runner.graphs is None) == eager
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_dummy_weights_are_made_on_the_gpu(model_factory, tmp_path):
    import shutil

    for f in model_factory("llama").iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    llm = LLM(str(tmp_path), device="cuda", load_format="dummy", **SMALL)
    runner = llm.engine.core.runner
    assert runner.dtype == torch.bfloat16
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in runner.model.parameters())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_kv_cache_is_sized_from_gpu_memory(model_factory):
    _free_gpu()
    free, total = torch.cuda.mem_get_info()
    fraction = round(min(0.5, 0.8 * free / total), 2)
    llm = LLM(str(model_factory("llama")), device="cuda", gpu_memory_utilization=fraction, max_num_seqs=8)
    runner = llm.engine.core.runner
    budget = runner.kv_budget
    assert budget is not None and budget.total_bytes == total and budget.weights_bytes > 0
    assert budget.activation_peak_bytes > 0 and budget.num_blocks == runner.num_blocks + 1
    assert budget.kv_bytes <= fraction * total - budget.weights_bytes
    assert llm.engine.num_blocks == runner.num_blocks
    del llm, runner
    _free_gpu()


def test_sampling_on_the_device_is_seeded(model_factory):
    model_dir = model_factory("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    params = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.01,
        repetition_penalty=1.1,
        seed=7,
        logprobs=2,
        max_tokens=16,
        ignore_eos=True,
        logit_bias={5: 2.0},
    )
    prompts = [{"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]}, {"prompt_token_ids": [4, 5, 6]}]
    results = []
    for _ in range(2):
        llm = LLM(str(model_dir), device="cuda", speculative_config=spec, **SMALL)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        assert all(len(o.outputs[0].logprobs) == 16 for o in outs)
    assert results[0] == results[1]
