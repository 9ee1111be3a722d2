#!/usr/bin/env python
"""GPU benchmarks of the engine (issue 45), each writing one JSON file; they also run on a CPU with a
tiny shape (`--device cpu`), which is how they are known to run before a GPU session.

    bench.py limits     --device cuda --out limits.json              # HBM copy bandwidth, bf16 GEMM peak
    bench.py throughput --model DIR --out tp.json                    # nano-vllm's workload
    bench.py decode     --model DIR --out decode.json                # c=1 decode against the HBM roofline
    bench.py prefill    --model DIR --out prefill.json               # one long prefill against the GEMM peak
    bench.py profile    --model DIR --out profile.json --trace-dir D # torch profiler over decode steps

Models are folders with config.json and a tokenizer (benchmarks/gpu/make_config.py); the weights are
`load_format="dummy"`. Ratios are against the limits measured in the same process (or `--limits`, a
file `limits` wrote), never against a datasheet.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_of(fn: Any, device: str, repeats: int = 5) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_limits(device: str, small: bool) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second) and bf16 GEMM FLOP/s, best of five."""
    n_bytes = (64 << 20) if small else (2 << 30)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = best_of(lambda: dst.copy_(src), device)
    bandwidth = 2 * n_bytes / t
    m = 1024 if small else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    t = best_of(lambda: a @ b, device)
    return {"copy_bandwidth_bytes_per_s": bandwidth, "bf16_gemm_flops_per_s": 2 * m**3 / t, "gemm_size": m}


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sms=p.multi_processor_count)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def make_llm(args: argparse.Namespace, **overrides: Any) -> Any:
    from tandem import LLM

    kw: dict[str, Any] = dict(
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        seed=0,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kw["kv_cache_memory"] = args.kv_cache_memory
    kw.update(overrides)
    return LLM(args.model, **kw)


def model_bytes(llm: Any) -> tuple[int, float]:
    """(weight bytes, KV bytes per token of context) of the loaded model."""
    runner = llm.engine.core.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    per_block = runner.kv_bytes_per_block(runner.model_config, runner.block_size, runner.kv_format)
    return weights, per_block / runner.block_size


def engine_info(llm: Any) -> dict[str, Any]:
    runner = llm.engine.core.runner
    budget = runner.kv_budget
    return {
        "plan": {
            "device": runner.plan.device,
            "attention_backend": runner.plan.attention_backend,
            "decode_graphs": runner.plan.decode_graphs,
        },
        "dtype": str(runner.dtype).removeprefix("torch."),
        "num_kv_blocks": runner.num_blocks,
        "block_size": runner.block_size,
        "kv_budget": None if budget is None else {k: getattr(budget, k) for k in budget.__slots__},
        "graph_sizes": None if runner.graphs is None else runner.graphs.sizes,
        "graph_error": runner.graph_error,
        "graph_steps": None if runner.graphs is None else runner.graphs.steps,
    }


def params(max_tokens: int) -> Any:
    from tandem import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def run_steps(llm: Any) -> list[float]:
    """Step the engine until every request has finished; each step's seconds."""
    engine, times = llm.engine, []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step(emit_unfinished=False)
        times.append(time.perf_counter() - t0)
    return times


# -- the benchmarks ---------------------------------------------------------------------


def bench_throughput(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    """nano-vllm's bench.py: random prompts of `--min-len`..`--max-len` token ids and as many
    output tokens, ignore_eos, all submitted at once; output tokens per second of the timed run.
    The decode steps (from the step trace) are set against the bytes each must read."""
    from tandem.engine.step_trace import read_step_trace

    rng = random.Random(0)
    trace = Path(args.out).with_suffix(".steps.jsonl")
    trace.unlink(missing_ok=True)
    llm = make_llm(args, step_trace=str(trace))
    vocab = min(10000, llm.engine.model_config.vocab_size)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_seqs)
    ]
    outs = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_seqs)]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params(8), use_tqdm=False)  # warm-up
    skip = len(read_step_trace(trace)) if trace.exists() else 0
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], [params(n) for n in outs], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = read_step_trace(trace)[skip:]
    weights, kv_per_token = model_bytes(llm)
    bw = limits["copy_bandwidth_bytes_per_s"]
    decode = [s for s in steps if s["prefill_tokens"] == 0 and s["decode_rows"] > 0]
    roofline = [(weights + s["context_tokens"] * kv_per_token) / bw for s in decode]
    return {
        "workload": {"num_seqs": args.num_seqs, "min_len": args.min_len, "max_len": args.max_len},
        "elapsed_s": elapsed,
        "output_tokens": sum(outs),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens_per_s": sum(outs) / elapsed,
        "steps": len(steps),
        "decode_steps": len(decode),
        "decode_seconds": sum(s["seconds"] for s in decode),
        "decode_roofline_seconds": sum(roofline),
        "decode_fraction_of_roofline": sum(roofline) / max(1e-12, sum(s["seconds"] for s in decode)),
        "engine": engine_info(llm),
    }


def bench_decode(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    """One request (c=1): `--prompt-len` prompt tokens, `--output-len` outputs; each decode step's
    time against the bytes it must read (every weight, the context's KV) at the copy bandwidth."""
    llm = make_llm(args)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params(8), use_tqdm=False)  # warm-up
    prompt = [(7 * i) % 1000 + 3 for i in range(args.prompt_len)]
    llm.engine.add_request("c1", {"prompt_token_ids": prompt}, params(args.output_len))
    times = run_steps(llm)
    decode = times[1:]  # the first step is the prompt's
    weights, kv_per_token = model_bytes(llm)
    context = args.prompt_len + args.output_len / 2
    per_token_bytes = weights + context * kv_per_token
    roofline = per_token_bytes / limits["copy_bandwidth_bytes_per_s"]
    median = statistics.median(decode)
    return {
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "decode_step_median_s": median,
        "decode_step_mean_s": statistics.fmean(decode),
        "decode_tokens_per_s": 1.0 / median,
        "bytes_per_token": per_token_bytes,
        "weight_bytes": weights,
        "roofline_step_s": roofline,
        "fraction_of_roofline": roofline / median,
        "engine": engine_info(llm),
    }


def bench_prefill(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    """A `--tokens`-token prompt in one step (budget = the prompt), best of `--repeats`, against
    its FLOPs (2 per weight per token in the linear layers, plus causal attention) at the GEMM peak."""
    t = args.tokens
    llm = make_llm(
        args,
        max_num_batched_tokens=t,
        max_model_len=max(args.max_model_len or 0, t + 8),
        enable_prefix_caching=False,
    )
    cfg = llm.engine.model_config
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params(1), use_tqdm=False)
    best = float("inf")
    for r in range(args.repeats):
        prompt = [(r * 31 + 7 * i) % 1000 + 3 for i in range(t)]
        llm.engine.add_request(f"p{r}", {"prompt_token_ids": prompt}, params(1))
        times = run_steps(llm)
        best = min(best, times[0])
    runner = llm.engine.core.runner
    linear = sum(m.weight.numel() for m in runner.model.modules() if isinstance(m, torch.nn.Linear)) + (
        cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0
    )
    linear_flops = 2 * t * linear
    attention_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2
    flops = linear_flops + attention_flops
    return {
        "tokens": t,
        "step_s": best,
        "flops": flops,
        "flops_per_s": flops / best,
        "fraction_of_peak": flops / best / limits["bf16_gemm_flops_per_s"],
        "engine": engine_info(llm),
    }


def bench_profile(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    """`--num-seqs` requests decoding together; `--profile-steps` decode steps under torch's profiler.
    The trace goes to `--trace-dir`; the summary: how much of the window the GPU ran kernels, and
    the longest gap between two kernels."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(args)
    engine = llm.engine
    for i in range(args.num_seqs):
        prompt = [(i * 13 + 7 * j) % 1000 + 3 for j in range(args.prompt_len)]
        engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params(args.output_len))
    # Until every request decodes (its prompt done), then the profiled steps.
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step(emit_unfinished=False)
    for _ in range(4):
        engine.step(emit_unfinished=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    trace_dir = Path(args.trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            engine.step(emit_unfinished=False)
        sync(args.device)
        window = time.perf_counter() - t0
    trace = trace_dir / "decode_trace.json"
    prof.export_chrome_trace(str(trace))
    kernels = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in json.loads(trace.read_text()).get("traceEvents", [])
        if e.get("cat") == "kernel"
    )
    busy, gaps, end = 0.0, [], None
    for start, stop in kernels:
        if end is None or start >= end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    run_steps(llm)
    return {
        "num_seqs": args.num_seqs,
        "profile_steps": args.profile_steps,
        "window_s": window,
        "step_s": window / args.profile_steps,
        "trace": str(trace),
        "kernels": len(kernels),
        "kernel_span_us": span,
        "gpu_busy_fraction_of_span": busy / span if span else None,
        "longest_gap_us": max(gaps) if gaps else None,
        "gaps_over_20us": sum(1 for g in gaps if g > 20),
        "engine": engine_info(llm),
    }


BENCHES = {
    "throughput": bench_throughput,
    "decode": bench_decode,
    "prefill": bench_prefill,
    "profile": bench_profile,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", choices=["limits", *BENCHES])
    ap.add_argument("--model", help="a folder with config.json and a tokenizer (make_config.py)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--limits", help="a JSON file `bench.py limits` wrote (else measured here)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="CPU only")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args()
    small = args.device != "cuda"
    if args.limits:
        saved = json.loads(Path(args.limits).read_text())
        limits = saved.get("limits", saved)
    else:
        limits = measure_limits(args.device, small)
    result: dict[str, Any] = {"bench": args.bench, "machine": machine(args.device), "limits": limits}
    if args.bench != "limits":
        if not args.model:
            ap.error(f"{args.bench} needs --model")
        if args.bench == "profile" and not args.trace_dir:
            args.trace_dir = str(Path(args.out).parent)
        result["model"] = args.model
        result.update(BENCHES[args.bench](args, limits))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("engine", "machine")}, default=str)[:600])


if __name__ == "__main__":
    main()
