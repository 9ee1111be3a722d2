"""Moving a quantized KV cache between engines: `read_blocks` / `write_blocks` carry every byte of a
block (values and scales), live migration and the prefill/decode hand-off keep an int8 engine's
greedy tokens, and engines whose caches hold different formats refuse each other's blocks."""

from __future__ import annotations

import pytest
import torch
from cluster_harness import Cluster

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest
from tandem.kvtransfer.protocol import MoveOutcome
from tandem.kvtransfer.transport import _as_buffer

# The harness delivers every message before the next step, so a move's length in steps is fixed;
# 60 tokens leave the moved request tens of steps of decoding after its move completes.
GREEDY = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
PROMPTS = [list(range(5, 5 + 37)), list(range(60, 60 + 21))]


def config(model_dir, kv_cache_dtype: str = "int8", **kw) -> EngineConfig:
    base = dict(
        model=str(model_dir),
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=96,
        num_threads=1,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=8,
    )
    base.update(kw)
    return EngineConfig(**base)


def reference(cfg: EngineConfig, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    llm = LLM(cfg.model, kv_cache_dtype=cfg.kv_cache_dtype, num_kv_blocks=96, num_threads=1, block_size=4)
    return list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_read_then_write_blocks_is_bit_exact(llama_dir, kv_cache_dtype) -> None:
    llm = LLM(str(llama_dir), kv_cache_dtype=kv_cache_dtype, num_kv_blocks=16, block_size=4, num_threads=1)
    runner = llm.engine.core.runner
    fmt, mc = runner.kv_format, runner.model_config
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        values = torch.randn(2, 16, 4, mc.num_kv_heads, mc.head_dim, generator=g)
        values *= torch.logspace(-3, 3, 16)[None, :, None, None, None]  # each block its own scales
        cache.copy_(fmt.quantize(values))
    src, dst = [3, 0, 9], [12, 5, 7]
    data = runner.read_blocks(src)
    payload = memoryview(_as_buffer(data))  # as the transport sends it
    assert payload.nbytes == 3 * runner.kv_bytes_per_block(mc, 4, fmt)
    runner.write_blocks(dst, payload)
    scale_bytes = slice(fmt.row_size(mc.head_dim) - 4, None)
    for cache in runner.kv_caches:
        assert torch.equal(cache[:, dst], cache[:, src])
        assert cache[:, dst][..., scale_bytes].any()  # the scales came too, not just the values
    with pytest.raises(ValueError, match="bytes"):
        runner.write_blocks(dst[:2], payload)


def test_live_migration_and_handoff_keep_int8_tokens(llama_dir, tmp_path) -> None:
    """One request moves mid-decode, the other is prefilled on node 0 and handed to node 1."""
    cfg = config(llama_dir)
    cluster = Cluster(cfg, tmp_path)
    try:
        cluster.add(EngineCoreRequest("r0", PROMPTS[0], GREEDY, GREEDY.max_tokens, 0.0), 0)
        cluster.add_disaggregated(EngineCoreRequest("r1", PROMPTS[1], GREEDY, GREEDY.max_tokens, 0.0), 0, 1)
        for _ in range(12):
            cluster.tick()
        assert cluster.migrate("r0", 1)
        cluster.settle()
        assert cluster.outcomes == [MoveOutcome.COMPLETED] * 2, cluster.abandoned
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()
    for i, prompt in enumerate(PROMPTS):
        assert cluster.requests[f"r{i}"].tokens[0] == reference(cfg, prompt), i


@pytest.mark.parametrize(("source", "dest"), [("int8", "fp8"), ("int8", "auto")])
def test_other_format_is_refused(llama_dir, tmp_path, source, dest) -> None:
    """int8 and fp8 blocks have the same size: only the format named in Begin tells them apart. The
    destination refuses, the request finishes where it is, nothing is held on either side."""
    cfg = config(llama_dir, source)
    cluster = Cluster(cfg, tmp_path)
    try:
        cluster.replace_node(1, config(llama_dir, dest), f"ipc://{tmp_path}/kv1-{dest}")
        cluster.add(EngineCoreRequest("r0", PROMPTS[0], GREEDY, GREEDY.max_tokens, 0.0), 0)
        for _ in range(8):
            cluster.tick()
        assert cluster.migrate("r0", 1)
        cluster.settle()
        assert cluster.outcomes == [MoveOutcome.REFUSED] and len(cluster.abandoned) == 1
        dest_name = {"fp8": "fp8_e4m3", "auto": "float32"}[dest]
        assert f"KV cache dtype int8 does not match this instance's {dest_name}" in cluster.abandoned[0]
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()
    assert cluster.requests["r0"].tokens[0] == reference(cfg, PROMPTS[0])
