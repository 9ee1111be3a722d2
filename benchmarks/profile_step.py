#!/usr/bin/env python
"""Where a decode step's time goes: torch profiler over steady-state engine steps.

Runs `--concurrency` requests through the engine offline until all are decoding, then profiles
`--steps` steps and groups the operators' self CPU time into GEMM, attention, elementwise/norm,
indexing/copies, sampling and other, next to the engine's own overhead (step time outside the
model forward). Prints a table and writes JSON.

    python benchmarks/profile_step.py --model benchmarks/.cache/llama-415m --concurrency 8

`--no-profile` times the same steps without the profiler (whose per-operator cost inflates the
small operators): the step, the forward (with logits) and what the engine spends outside it
(scheduling, batch building, sampling, outputs), the work an asynchronous scheduler could overlap.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

GROUPS = {
    "gemm": (
        "aten::mm",
        "aten::addmm",
        "aten::linear",
        "aten::_weight_int8pack_mm",
        "aten::bmm",
        "mkl",
        "mkldnn",
        "tandem::gemm",
        "tandem::gemv",
    ),
    "attention": ("scaled_dot_product", "_scaled_dot_product", "aten::_softmax", "tandem::paged_attention"),
    "index/copy": (
        "aten::index",
        "aten::index_copy_",
        "aten::index_put_",
        "aten::copy_",
        "aten::cat",
        "aten::embedding",
        "aten::to",
        "aten::_to_copy",
        "aten::clone",
        "aten::contiguous",
    ),
    "sampling": ("aten::argmax", "aten::sort", "aten::exponential_", "aten::softmax", "aten::topk"),
    "elementwise/norm": (
        "aten::mul",
        "aten::add",
        "aten::sub",
        "aten::neg",
        "aten::rsqrt",
        "aten::pow",
        "aten::mean",
        "aten::silu",
        "aten::div",
        "aten::where",
        "tandem::silu_mul",
        "tandem::rms_norm",
        "tandem::add_rms_norm",
        "tandem::rope_",
    ),
}


def group_of(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(name.startswith(k) or k in name for k in keys):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-profile", action="store_true", help="time the steps only, no profiler")
    args = ap.parse_args()

    import torch

    from tandem import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=max(2048, args.concurrency * args.prompt_len),
        num_threads=args.threads,
    )
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 16, ignore_eos=True)
    for i in range(args.concurrency):
        ids = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    core = engine.core
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        engine.step(emit_unfinished=False)
    for _ in range(3):  # warm up the decode shapes
        engine.step()
    settings = {
        "model": args.model or "default",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "concurrency": args.concurrency,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
    }
    report = (
        timed_steps(engine, args, settings) if args.no_profile else profiled_steps(engine, args, settings)
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


def timed_steps(engine: Any, args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    """The steps without the profiler: step time against forward (with logits) time."""
    core = engine.core
    before = core.snapshot()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step(emit_unfinished=False)
    wall = (time.perf_counter() - t0) / args.steps
    after = core.snapshot()
    forward = (after["engine_forward_seconds"] - before["engine_forward_seconds"]) / args.steps
    report = {
        **settings,
        "step_ms": 1e3 * wall,
        "forward_ms": 1e3 * forward,
        "outside_forward_ms": 1e3 * (wall - forward),
        "outside_forward_fraction": (wall - forward) / wall,
    }
    print(
        f"{report['model']} {args.dtype} q={args.quantization} c={args.concurrency}: step "
        f"{report['step_ms']:.2f} ms, forward + logits {report['forward_ms']:.2f} ms, outside "
        f"{report['outside_forward_ms']:.2f} ms ({100 * report['outside_forward_fraction']:.1f}%)"
    )
    return report


def profiled_steps(engine: Any, args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    """The steps under the torch profiler: operator self time by group, and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    core = engine.core
    before = core.snapshot()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step(emit_unfinished=False)
    wall = time.perf_counter() - t0
    after = core.snapshot()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        totals[group_of(evt.key)] += evt.self_cpu_time_total / 1e6
    step = (after["engine_step_seconds"] - before["engine_step_seconds"]) / args.steps
    forward = (after["engine_forward_seconds"] - before["engine_forward_seconds"]) / args.steps
    profiled = sum(totals.values())
    report = {
        **settings,
        "step_ms_profiled": 1e3 * wall / args.steps,
        "step_ms": 1e3 * step,
        "forward_ms": 1e3 * forward,
        "engine_overhead_fraction": (step - forward) / step if step else 0.0,
        "self_cpu_share": {k: v / profiled for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "top_ops": [
            {"op": e.key, "calls": e.count, "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ],
    }
    print(
        f"{report['model']} {args.dtype} q={args.quantization} c={args.concurrency}: "
        f"step {report['step_ms']:.1f} ms (forward {report['forward_ms']:.1f} ms, "
        f"engine overhead {100 * report['engine_overhead_fraction']:.1f}%)"
    )
    for k, v in report["self_cpu_share"].items():
        print(f"  {k:18s} {100 * v:5.1f}% of operator self time")
    for op in report["top_ops"]:
        print(f"  {op['op']:40s} {op['calls']:6d} calls {op['self_ms_per_step']:8.2f} ms/step")
    return report


if __name__ == "__main__":
    main()
