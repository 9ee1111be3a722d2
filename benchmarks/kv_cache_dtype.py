"""KV cache quantization (`kv_cache_dtype`): KV capacity in tokens and output throughput at c=64.

For each configuration (model dtype, kv_cache_dtype), on the embedded default model unless `--model`:
- capacity: the tokens the same `kv_cache_memory` holds (the engine's own block count times the
  block size), and the ratio to bfloat16's and float32's;
- throughput: 64 prompts of fixed length (seeded random token ids), greedy, `ignore_eos`, a fixed
  number of output tokens, handed to `LLM.generate` at once (offline, c=64), after a warm-up call;
  output tokens per second, preemptions, and the forward's share of the time.
Throughput runs at two budgets: `--kv-cache-memory` (default 2 GiB: every sequence fits in every
format, so the figure is the cost of quantizing and dequantizing) and a tight one, the bytes a
bfloat16 cache needs for `--tight-seqs` of the 64 sequences at full length (a quantized cache fits
about twice as many: fewer preemptions and recomputation).

    .venv/bin/python benchmarks/kv_cache_dtype.py                  # the default model, c=64
    .venv/bin/python benchmarks/kv_cache_dtype.py --quick --result-json /tmp/kv.json   # smoke test

Prints a table and writes every figure as JSON (default benchmarks/results/kv_cache_dtype.json).
Timings need an idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tandem.config import DEFAULT_MAX_NUM_BATCHED_TOKENS  # noqa: E402

# (model dtype, kv_cache_dtype): the float caches, and the quantized ones under each model dtype.
CONFIGS = [
    ("float32", "auto"),
    ("bfloat16", "auto"),
    ("float32", "int8"),
    ("float32", "fp8"),
    ("bfloat16", "int8"),
    ("bfloat16", "fp8"),
]


def kv_bytes_per_token(model: str, dtype: str, kv_cache_dtype: str) -> int:
    import torch

    from tandem.config import ModelConfig
    from tandem.model.kv_quant import KVCacheFormat
    from tandem.model.loader import resolve_dtype

    mc = ModelConfig.from_pretrained(model)
    fmt = KVCacheFormat(kv_cache_dtype, resolve_dtype(dtype, torch.device("cpu")))
    return 2 * mc.num_layers * mc.num_kv_heads * fmt.row_bytes(mc.head_dim)


def capacity(model: str, dtype: str, kv_cache_dtype: str, memory: int, block_size: int) -> dict[str, Any]:
    """What the engine would allocate for `memory` bytes (computed as it does, nothing allocated)."""
    from tandem.config import EngineConfig, ModelConfig
    from tandem.engine.core import num_kv_blocks

    mc = ModelConfig.from_pretrained(model)
    cfg = EngineConfig(
        model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=memory, block_size=block_size
    )
    blocks = num_kv_blocks(cfg, mc, mc.max_position_embeddings)
    return {
        "kv_bytes_per_token": kv_bytes_per_token(model, dtype, kv_cache_dtype),
        "num_blocks": blocks,
        "tokens": blocks * block_size,
    }


def throughput(
    model: str,
    dtype: str,
    kv_cache_dtype: str,
    memory: int,
    prompts: list[list[int]],
    output_len: int,
    args: Any,
) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=memory,
        block_size=args.block_size,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        num_threads=args.threads,
    )
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    before = llm.get_stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.get_stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == output_len * len(prompts)
    result = {
        "kv_cache_memory": memory,
        "kv_tokens": llm.engine.num_blocks * args.block_size,
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / seconds,
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "num_steps": after["engine_steps"] - before["engine_steps"],
        "forward_fraction": (after["engine_forward_seconds"] - before["engine_forward_seconds"])
        / max(1e-9, after["engine_step_seconds"] - before["engine_step_seconds"]),
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--kv-cache-memory", type=int, default=2 << 30, help="bytes, for capacity and the ample run"
    )
    ap.add_argument(
        "--tight-seqs", type=int, default=32, help="the tight run's budget: bfloat16 KV for this many"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--configs", default=",".join(f"{d}:{k}" for d, k in CONFIGS), help="dtype:kv_cache_dtype,..."
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 short prompts and a small cache: a smoke test")
    ap.add_argument("--result-json", type=Path, default=REPO_ROOT / "benchmarks/results/kv_cache_dtype.json")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 8, 32, 8
        args.kv_cache_memory, args.tight_seqs = 16 << 20, 4
    from tandem.checkpoints import default_model_path
    from tandem.config import ModelConfig

    model = args.model or default_model_path()
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    vocab = ModelConfig.from_pretrained(model).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    # The tight budget holds exactly `tight_seqs` whole sequences' blocks in bfloat16.
    blocks_per_seq = -(-(args.input_len + args.output_len) // args.block_size)
    bf16_block = kv_bytes_per_token(model, "bfloat16", "auto") * args.block_size
    tight = bf16_block * blocks_per_seq * args.tight_seqs

    rows = []
    for dtype, kv in configs:
        cap = capacity(model, dtype, kv, args.kv_cache_memory, args.block_size)
        row = {"dtype": dtype, "kv_cache_dtype": kv, "capacity": cap}
        row["ample"] = throughput(model, dtype, kv, args.kv_cache_memory, prompts, args.output_len, args)
        row["tight"] = throughput(model, dtype, kv, tight, prompts, args.output_len, args)
        rows.append(row)
        print(
            f"{dtype:>9} {kv:>5}: {cap['tokens']:>9} KV tokens ({cap['kv_bytes_per_token']} B/token); "
            f"ample {row['ample']['output_tokens_per_s']:.1f} tok/s, "
            f"tight ({row['tight']['kv_tokens']} tokens) {row['tight']['output_tokens_per_s']:.1f} tok/s, "
            f"{row['tight']['num_preemptions']} preemptions",
            flush=True,
        )
    base = {r["dtype"]: r for r in rows if r["kv_cache_dtype"] == "auto"}
    print("\ndtype     kv     tokens  x bf16  x fp32  ample tok/s  x auto  tight tok/s  x auto  preempt")
    for r in rows:
        own = base.get(r["dtype"])
        ratios = {
            name: r["capacity"]["tokens"] / b["capacity"]["tokens"]
            for name, b in (("bfloat16", base.get("bfloat16")), ("float32", base.get("float32")))
            if b is not None
        }
        r["capacity_vs"] = ratios
        if own is not None:
            r["throughput_vs_auto"] = {
                k: r[k]["output_tokens_per_s"] / own[k]["output_tokens_per_s"] for k in ("ample", "tight")
            }
        vs = r.get("throughput_vs_auto", {})
        print(
            f"{r['dtype']:<9} {r['kv_cache_dtype']:<5} {r['capacity']['tokens']:>8} "
            f"{ratios.get('bfloat16', float('nan')):>6.2f}  {ratios.get('float32', float('nan')):>6.2f}  "
            f"{r['ample']['output_tokens_per_s']:>11.1f}  {vs.get('ample', float('nan')):>6.2f}  "
            f"{r['tight']['output_tokens_per_s']:>11.1f}  {vs.get('tight', float('nan')):>6.2f}  "
            f"{r['tight']['num_preemptions']:>7}"
        )
    import torch

    result = {
        "command_line": shlex.join([sys.executable, *sys.argv]),
        "model": model,
        "quick": args.quick,
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_memory": args.kv_cache_memory,
            "tight_kv_cache_memory": tight,
            "tight_seqs": args.tight_seqs,
        },
        "torch_num_threads": torch.get_num_threads(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
        "rows": rows,
    }
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.result_json}")


if __name__ == "__main__":
    main()
