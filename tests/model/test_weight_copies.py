"""A model whose linear weights would not fit twice loads them once (`pack_linears`): the engine
then serves from one copy, with the same greedy output as from two."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.cpu import cpu_flags
from tandem.model import linear
from tandem.model.linear import PackedLinear


def _layers(llm: LLM) -> list[PackedLinear]:
    model = llm.engine.core.runner.model
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_memory_loads_one_copy_and_serves_the_same_tokens(llama_dir, monkeypatch, dtype):
    if not linear.onednn_available():
        pytest.skip("no oneDNN packing on this CPU")
    if dtype == "bfloat16" and not {"amx_bf16", "avx512_bf16"} & cpu_flags():
        pytest.skip("without native bfloat16 the layers keep one plain copy (no packed form)")
    prompts = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": list(range(100, 107))}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    two = LLM(str(llama_dir), dtype=dtype, num_kv_blocks=64)
    tiled = dtype == "bfloat16" and linear.amx_tiles_available()
    # AVX512-BF16 without AMX: the panels alone at every row count, whatever the memory.
    panels_only = dtype == "bfloat16" and not tiled and linear.bf16_panels_every_row_count()
    if panels_only:
        assert all(m.packed is None and m.panels is not None for m in _layers(two))
    # Two forms where a layer has a few-row path beside oneDNN's; on AMX, layers no wider out than
    # in (o_proj, down_proj) run on their tiles alone either way.
    assert all(m.packed is not None or (tiled and m.out_features <= m.in_features) or panels_only for m in _layers(two))
    want = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(linear, "available_memory", lambda: 1024)  # far less than the weights
    one = LLM(str(llama_dir), dtype=dtype, num_kv_blocks=64)
    layers = _layers(one)
    assert layers and all(m.plain is None for m in layers)
    if tiled:
        assert all(m.packed is None and m.tiles is not None for m in layers)
    elif panels_only:
        assert all(m.packed is None and m.panels is not None for m in layers)
    else:
        assert all(m.packed is not None for m in layers)
    got = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    assert got == want
