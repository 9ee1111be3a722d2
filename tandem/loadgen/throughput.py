"""`tandem bench throughput`: offline generation through `LLM` with token-id prompts."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

from tandem.loadgen.datasets import build_dataset


def peak_rss_mb() -> float:
    """Peak resident memory of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def run_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from tandem import LLM, SamplingParams
    from tandem.entrypoints.llm import default_model_path

    model = args.model or default_model_path()
    llm = LLM(model, **engine_kwargs)
    tok = llm.get_tokenizer()
    samples = build_dataset(args, args.num_prompts, tok)
    prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
    params = [
        SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=args.ignore_eos) for s in samples
    ]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = max(time.perf_counter() - t0, 1e-9)
    in_tokens = sum(len(s.prompt_token_ids or []) for s in samples)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.get_stats()
    steps = max(stats["engine_steps"], 1)
    result = {
        "model": model,
        "dataset": args.dataset,
        "num_prompts": len(samples),
        "elapsed_s": elapsed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(samples) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "peak_rss_mb": peak_rss_mb(),
        "num_steps": stats["engine_steps"],
        "mean_step_ms": 1e3 * stats["engine_step_seconds"] / steps,
        "mean_forward_ms": 1e3 * stats["engine_forward_seconds"] / steps,
        # Everything in a step but the model forward (and draft passes): scheduling, input
        # building, sampling, bookkeeping.
        "engine_overhead_fraction": stats["engine_overhead_fraction"],
    }
    print(
        f"Throughput: {result['request_throughput']:.2f} req/s, "
        f"{result['output_throughput']:.2f} output tok/s, {result['total_token_throughput']:.2f} total tok/s, "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB\n"
        f"Steps: {result['num_steps']}, mean {result['mean_step_ms']:.2f} ms "
        f"(model forward {result['mean_forward_ms']:.2f} ms); "
        f"engine overhead {100 * result['engine_overhead_fraction']:.1f}% of step time"
    )
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
