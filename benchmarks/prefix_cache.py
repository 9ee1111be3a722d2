"""Prefix caching: TTFT and throughput on a shared-system-prompt workload, caching on vs off.

Every request is one shared "system prompt" (token ids cut from tokenized Python stdlib sources)
followed by a distinct question, greedy, `ignore_eos`, a fixed number of output tokens. The same
workload runs through two fresh engines in one process, `enable_prefix_caching=False` and `True`,
each handed all requests at once by `LLM.generate`. Prints a table with the on/off ratio and writes
every figure as JSON.

    .venv/bin/python benchmarks/prefix_cache.py              # ~125M-param Llama, 32 requests
    .venv/bin/python benchmarks/prefix_cache.py --quick      # tiny model, 8 requests: a smoke test
    .venv/bin/python benchmarks/prefix_cache.py --model PATH # an existing checkpoint

TTFT is per request: `metrics.first_token_time - metrics.arrival_time` (arrival is when `generate`
added the request, so TTFT includes queueing behind the requests admitted before it). The hit rate
is the prefix cache's reused prompt tokens over all prompt tokens of the measured call. The cache
starts cold: requests admitted in the same step as the first one compute the system prompt too
(each step only reuses what earlier steps computed), so the ideal, only the first request missing,
(N - 1) * floor(prefix_len / block_size) * block_size hit tokens, is an upper bound. With
`--warm-prefix` the system prompt is run once before the measured call (steady state; ideal: all N
requests hit). Without `--model` the checkpoint is built (and cached under `--cache-dir`) by
`throughput.py`'s code, so both benchmarks share one checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # sets HF_HUB_OFFLINE, puts the repo root on sys.path

REPO_ROOT = tp.REPO_ROOT
WARMUP_SALT = "prefix-cache-benchmark-warmup"  # keeps the warm-up request out of the measured cache


# -- workload -----------------------------------------------------------------------------------


def make_workload(
    corpus: list[int],
    num_requests: int,
    prefix_len: int,
    question_range: tuple[int, int],
    output_len: int,
    seed: int,
) -> tp.Workload:
    """A shared system prompt of `prefix_len` tokens plus one distinct question per request."""
    rng = random.Random(seed)
    longest = max(prefix_len, question_range[1])
    if len(corpus) < 2 * longest:
        raise RuntimeError(f"tokenized corpus has {len(corpus)} tokens, fewer than {2 * longest}")
    start = rng.randrange(len(corpus) - prefix_len + 1)
    system = corpus[start : start + prefix_len]
    prompts, seen = [], set()
    while len(prompts) < num_requests:
        n = rng.randint(*question_range)
        q_start = rng.randrange(len(corpus) - n + 1)
        question = tuple(corpus[q_start : q_start + n])
        if question in seen:
            continue
        seen.add(question)
        prompts.append(system + list(question))
    return tp.Workload(prompts, [output_len] * num_requests)


def ideal_hit_tokens(work: tp.Workload, prefix_len: int, block_size: int, warm_prefix: bool) -> int:
    """Hits when every request reuses the system prompt's whole blocks, except the first one unless
    the prefix was warmed (a question sharing tokens with another could add a block; ignored)."""
    reusers = len(work.prompts) - (0 if warm_prefix else 1)
    return reusers * (prefix_len // block_size * block_size)


# -- one run --------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pct(p: float) -> float:  # nearest rank
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

    return {
        "mean": statistics.fmean(ordered),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "min": ordered[0],
        "max": ordered[-1],
    }


def run_engine(
    model_path: Path,
    work: tp.Workload,
    engine_args: dict[str, Any],
    caching: bool,
    warm_prefix: list[int] | None = None,
) -> tp.RunResult:
    from tandem import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(model_path), dtype="float32", enable_prefix_caching=caching, **engine_args)
    load_s = time.perf_counter() - start
    # Warm up on a salted prompt: with caching on it lands in its own tree and cannot be reused.
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate({"prompt_token_ids": work.prompts[0][:16], "cache_salt": WARMUP_SALT}, warm, use_tqdm=False)
    if warm_prefix is not None:  # steady state: the system prompt is already cached (when caching is on)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate({"prompt_token_ids": warm_prefix}, one, use_tqdm=False)

    engine = llm.engine
    kv, stats = engine.kv, engine.counters
    hits0, queries0 = stats.prefix_cache_hits, stats.prefix_cache_queries
    steps0, batched0, preempt0 = stats.engine_steps, stats.num_batched_tokens, stats.num_preemptions
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start

    ttft = []
    for o in outs:
        m = o.metrics
        if m is None or m.first_token_time is None:
            raise RuntimeError(f"request {o.request_id} has no first-token time")
        ttft.append(m.first_token_time - m.arrival_time)
    hit_tokens = stats.prefix_cache_hits - hits0
    query_tokens = stats.prefix_cache_queries - queries0
    extra: dict[str, Any] = {
        "enable_prefix_caching": caching,
        "load_time_s": load_s,
        "engine_args": {"dtype": "float32", **engine_args},
        "num_kv_blocks_allocated": engine.num_blocks,
        "engine_steps": stats.engine_steps - steps0,
        "num_batched_tokens": stats.num_batched_tokens - batched0,
        "num_preemptions": stats.num_preemptions - preempt0,
        "prefix_hit_tokens": hit_tokens,
        "prefix_query_tokens": query_tokens,
        "prefix_hit_rate": hit_tokens / query_tokens if query_tokens else 0.0,
        "num_cached_tokens_per_request": [o.metrics.num_cached_tokens for o in outs],
        "ttft_s": percentiles(ttft),
        "ttft_per_request_s": ttft,
    }
    del llm, engine, kv, stats
    gc.collect()
    return tp.RunResult(wall, [list(o.outputs[0].token_ids) for o in outs], extra)


# -- reporting ----------------------------------------------------------------------------------


def print_table(off: dict[str, Any], on: dict[str, Any], ratio: dict[str, float]) -> None:
    header = (
        f"{'prefix caching':<16} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12} "
        f"{'TTFT mean s':>12} {'TTFT p50 s':>11} {'TTFT p90 s':>11} {'computed tok':>13} {'hit rate':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, r in (("off", off), ("on", on)):
        t = r["ttft_s"]
        print(
            f"{name:<16} {r['wall_time_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
            f"{r['total_tokens_per_s']:>12.1f} {t['mean']:>12.3f} {t['p50']:>11.3f} {t['p90']:>11.3f} "
            f"{r['num_batched_tokens']:>13d} {r['prefix_hit_rate']:>8.1%}"
        )
    print(
        f"{'ratio on / off':<16} {ratio['speedup_wall_time']:>7.2f}x {ratio['output_tokens_per_s']:>9.2f}x "
        f"{ratio['total_tokens_per_s']:>11.2f}x {ratio['ttft_mean_speedup']:>11.2f}x "
        f"{ratio['ttft_p50_speedup']:>10.2f}x {ratio['ttft_p90_speedup']:>10.2f}x "
        f"{ratio['computed_tokens']:>12.2f}x"
    )
    print("(wall time and TTFT columns of the ratio row: off / on, i.e. speedups; the others: on / off)")


# -- main ---------------------------------------------------------------------------------------


QUICK_DEFAULTS = dict(
    num_requests=8,
    prefix_len=256,
    min_question_len=16,
    max_question_len=32,
    output_len=8,
    max_num_batched_tokens=256,
)
FULL_DEFAULTS = dict(
    num_requests=32,
    prefix_len=1024,
    min_question_len=32,
    max_question_len=64,
    output_len=32,
    max_num_batched_tokens=2048,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="existing checkpoint folder (default: build a random Llama)")
    p.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "benchmarks" / ".cache")
    p.add_argument(
        "--result-json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "prefix_cache.json"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 8 requests: a ~10 s smoke test")
    p.add_argument("--num-requests", type=int, help="default 32 (quick: 8)")
    p.add_argument("--prefix-len", type=int, help="shared system prompt tokens, default 1024 (quick: 256)")
    p.add_argument("--min-question-len", type=int, help="default 32 (quick: 16)")
    p.add_argument("--max-question-len", type=int, help="default 64 (quick: 32)")
    p.add_argument("--output-len", type=int, help="output tokens per request, default 32 (quick: 8)")
    p.add_argument("--seed", type=int, default=0, help="workload and weight seed")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--max-num-batched-tokens", type=int, help="token budget per step, default 2048 (quick: 256)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        help="KV blocks for each engine (default: every request at full length at once, without sharing)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument(
        "--warm-prefix",
        action="store_true",
        help="before measuring, run the system prompt alone once (steady state: it is already cached); "
        "default: a cold cache, where requests admitted in the first step cannot share",
    )
    args = p.parse_args(argv)
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.preset = tp.QUICK if args.quick else tp.FULL
    for name in (
        "num_requests",
        "prefix_len",
        "min_question_len",
        "output_len",
        "block_size",
        "max_num_batched_tokens",
        "max_num_seqs",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_question_len < args.min_question_len:
        p.error("--max-question-len is below --min-question-len")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset: tp.Preset = args.preset
    built = args.model is None
    model_path = (
        tp.ensure_checkpoint(args.cache_dir, preset.shape, preset.corpus_bytes, args.seed)
        if built
        else args.model
    )
    model_cfg = tp.read_model_config(model_path)
    need = args.prefix_len + args.max_question_len + args.output_len
    if model_cfg["max_position_embeddings"] and need > model_cfg["max_position_embeddings"]:
        raise SystemExit(
            f"prefix + question + output ({need} tokens) exceeds max_position_embeddings of {model_path}"
        )

    corpus, tokenizer_size = tp.corpus_token_ids(model_path, preset.corpus_bytes, model_cfg["vocab_size"])
    work = make_workload(
        corpus,
        args.num_requests,
        args.prefix_len,
        (args.min_question_len, args.max_question_len),
        args.output_len,
        args.seed,
    )
    engine_args: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks or tp.default_kv_blocks(work, args.block_size),
    }
    if args.threads:
        engine_args["num_threads"] = args.threads
    ideal_hits = ideal_hit_tokens(work, args.prefix_len, args.block_size, args.warm_prefix)
    warm_prefix = work.prompts[0][: args.prefix_len] if args.warm_prefix else None

    print(
        f"model {model_path} ({'built, random weights' if built else 'given'}): {model_cfg}\n"
        f"workload: {args.num_requests} requests = a {args.prefix_len}-token shared system prompt + "
        f"a {args.min_question_len}..{args.max_question_len}-token question ({work.prompt_tokens} prompt "
        f"tokens), {args.output_len} output tokens each, greedy, ignore_eos; block size {args.block_size}, "
        f"{args.max_num_batched_tokens} tokens per step, "
        f"{'system prompt cached beforehand' if args.warm_prefix else 'cold cache'}; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    runs = {}
    for caching in (False, True):
        runs[caching] = run_engine(model_path, work, engine_args, caching, warm_prefix)
        print(f"prefix caching {'on' if caching else 'off'}: {runs[caching].wall_time_s:.2f} s", flush=True)

    off = tp.summarize(runs[False], work)
    on = tp.summarize(runs[True], work)
    for name, r in (("off", off), ("on", on)):
        if r["output_tokens_produced"] != work.output_tokens:
            print(
                f"WARNING: caching {name} produced {r['output_tokens_produced']} output tokens, "
                f"{work.output_tokens} were requested",
                flush=True,
            )
    ratio = {
        "output_tokens_per_s": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "total_tokens_per_s": on["total_tokens_per_s"] / off["total_tokens_per_s"],
        "speedup_wall_time": off["wall_time_s"] / on["wall_time_s"],
        "ttft_mean_speedup": off["ttft_s"]["mean"] / on["ttft_s"]["mean"],
        "ttft_p50_speedup": off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
        "ttft_p90_speedup": off["ttft_s"]["p90"] / on["ttft_s"]["p90"],
        "computed_tokens": on["num_batched_tokens"] / off["num_batched_tokens"],
    }
    result = {
        "command": [sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv],
        "command_line": shlex.join(sys.argv if argv is None else [__file__, *argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "torch_num_threads": torch.get_num_threads(),
        "model": {
            "path": str(model_path),
            "built_random_weights": built,
            "dtype": "float32",
            **model_cfg,
            "tokenizer_vocab_size": tokenizer_size,
        },
        "workload": {
            "num_requests": args.num_requests,
            "seed": args.seed,
            "prefix_len": args.prefix_len,
            "question_len_range": [args.min_question_len, args.max_question_len],
            "output_len": args.output_len,
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "warm_prefix": args.warm_prefix,
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.output_tokens,
            "input_lens": [len(p) for p in work.prompts],
            "temperature": 0.0,
            "ignore_eos": True,
            "ideal_prefix_hit_tokens": ideal_hits,
            "ideal_prefix_hit_rate": ideal_hits / work.prompt_tokens,
        },
        "caching_off": off,
        "caching_on": on,
        "ratio_on_over_off": ratio,
        "greedy_agreement": tp.greedy_agreement(runs[False].outputs, runs[True].outputs),
    }
    print()
    print(
        f"model: {tp._shape_line(model_cfg)} (tokenizer {tokenizer_size}), fp32, "
        f"{'random weights' if built else model_path}; torch threads {torch.get_num_threads()}"
    )
    print_table(off, on, ratio)
    agree = result["greedy_agreement"]
    print(
        f"prefix hit rate with caching {on['prefix_hit_rate']:.1%} "
        f"(ideal, {'every request' if args.warm_prefix else 'all but the first'} reusing the system "
        f"prompt: {ideal_hits / work.prompt_tokens:.1%}); "
        f"greedy outputs identical for {agree['num_exact_match']}/{agree['num_prompts']} requests"
    )
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.result_json}")
    return result


if __name__ == "__main__":
    main()
