"""Dispatch and migration policies side by side, and what a live migration costs a request.

Part 1: for each policy (round_robin, least_load, prefix_aware, and least_load with live migration
on imbalance) a fresh `tandem serve --num-instances N` (Ray, `--threads` per instance) gets the
same trace from `tandem bench serve`'s client: Gamma arrivals (`--burstiness` < 1 is burstier than
Poisson), prompts from a few shared prefixes plus a distinct suffix, output lengths spread by
`--range-ratio`, greedy, `ignore_eos`. Prints TTFT mean/p99, ITL p99, output throughput,
prefix-cache hit rate, preemptions and migrations per policy.

Part 2: migration cost against request length. Two engine processes behind one front end; a
request with an L-token prompt decodes on the first, and after 16 tokens is moved to the second,
live (KV copied in stages, then a stop-and-copy) or by recompute (resent; the destination
recomputes its KV). Reports the stop-and-copy time (the request paused until the destination took
it over), the whole migration's time, the bytes sent, and the gap the client sees between two
tokens across the move against its median inter-token gap. Plots it (`--plot`).

Every figure goes to JSON (`--result-json`).

    python benchmarks/cluster.py                       # default model, 2 instances x 1 thread
    python benchmarks/cluster.py --quick               # a smaller trace, fewer lengths
    python benchmarks/cluster.py --model PATH --instances 3 --result-json out.json

On a 2-core machine, 2 instances of one thread each use the whole machine and the client shares
it: the figures compare policies against each other, not against a bigger machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tandem.entrypoints.llm import default_model_path
from tandem.loadgen.serve import add_serve_bench_args, run_bench
from tandem.loadgen.server_process import ServerProcess

POLICIES = ("round_robin", "least_load", "prefix_aware", "least_load+migration")


def bench_args(url: str, model_name: str, tokenizer: str, a: argparse.Namespace) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    argv = ["--base-url", url, "--model", model_name, "--tokenizer", tokenizer]
    argv += ["--dataset", "prefix-repetition", "--num-prefixes", str(a.num_prefixes)]
    argv += ["--prefix-len", str(a.prefix_len), "--suffix-len", str(a.suffix_len)]
    argv += ["--output-len", str(a.output_len), "--range-ratio", "0.8", "--num-prompts", str(a.num_prompts)]
    argv += ["--request-rate", str(a.request_rate), "--burstiness", str(a.burstiness), "--ignore-eos"]
    argv += ["--seed", str(a.seed), "--disable-tqdm"]
    return p.parse_args(argv)


def summary(run: dict[str, Any]) -> dict[str, Any]:
    server = run.get("server_metrics") or {}
    return {
        "completed": run["completed"],
        "failed": run["failed"],
        "ttft_mean_ms": run["ttft_ms"]["mean"],
        "ttft_p99_ms": run["ttft_ms"]["p99"],
        "itl_p99_ms": run["itl_ms"]["p99"],
        "output_tok_s": run["output_throughput"],
        "prefix_hit_rate": server.get("prefix_cache_hit_rate"),
        "preemptions": server.get("preemptions"),
    }


# -- part 2: one request moved, live or by recompute -----------------------------------------


async def move_one(client: Any, rid: str, prompt: list[int], live: bool, after: int, max_tokens: int) -> dict:
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req, text = client.inputs.process(rid, {"prompt_token_ids": prompt}, params)
    notify = asyncio.Event()
    stream = client.add(req, text, notify, instance=0)
    arrivals: list[float] = []  # when each token reached the front end
    moved_at = None
    while True:
        await notify.wait()
        notify.clear()
        out = stream.take()
        if out is None:
            continue
        now = time.perf_counter()
        arrivals += [now] * (len(out.outputs[0].token_ids) - len(arrivals))
        if moved_at is None and len(arrivals) >= after:
            moved_at = len(arrivals)
            ok = client.migrate_live(rid, 1) if live else client.migrate(rid, 1)
            if not ok:
                raise RuntimeError(f"could not move {rid}")
        if out.finished:
            break
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    before = gaps[: moved_at - 1]
    return {"gap_ms": max(gaps[moved_at - 1 :]) * 1e3, "itl_median_ms": statistics.median(before) * 1e3}


async def downtime_phase(model: str, lengths: list[int], repeats: int, threads: int) -> list[dict[str, Any]]:
    from tandem.config import EngineConfig
    from tandem.engine.connection import ProcessConnection
    from tandem.engine.core_client import AsyncEngineClient

    config = EngineConfig(model=model, num_threads=threads, max_num_seqs=8, max_model_len=max(lengths) + 128)
    migrated: list[Any] = []
    client = AsyncEngineClient(
        config,
        connections=[ProcessConnection(config), ProcessConnection(config)],
        on_migrated=migrated.append,
    )
    await client.start(timeout=600)
    rng = random.Random(0)
    rows = []
    try:
        vocab = client.limits.vocab_size
        for length in lengths:
            for mode in ("live", "recompute"):
                runs = []
                for rep in range(repeats + 1):  # the first is a warm-up
                    prompt = [rng.randrange(3, vocab) for _ in range(length)]
                    before = len(migrated)
                    r = await move_one(client, f"{mode}-{length}-{rep}", prompt, mode == "live", 16, 48)
                    if mode == "live":
                        msg = migrated[before]
                        if not msg.ok:
                            raise RuntimeError(f"live migration failed: {msg.reason}")
                        r.update(
                            stop_copy_ms=msg.downtime_s * 1e3, kv_bytes=msg.num_bytes, stages=msg.num_stages
                        )
                    if rep:
                        runs.append(r)
                row = {"prompt_len": length, "mode": mode, "runs": runs}
                for key in ("gap_ms", "itl_median_ms", "stop_copy_ms", "kv_bytes", "stages"):
                    if key in runs[0]:
                        row[key] = statistics.median(x[key] for x in runs)
                rows.append(row)
                print(
                    f"  L={length:>5} {mode:<9} gap {row['gap_ms']:8.1f} ms  (itl {row['itl_median_ms']:.1f} ms)"
                    + (
                        f"  stop-and-copy {row['stop_copy_ms']:.2f} ms  {row['kv_bytes'] / 1e6:.2f} MB"
                        f"  {row['stages']:.0f} stage(s)"
                        if mode == "live"
                        else ""
                    ),
                    flush=True,
                )
    finally:
        await client.shutdown()
    return rows


def plot_downtime(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, style in (("live", "o-"), ("recompute", "s--")):
        pts = [(r["prompt_len"], r["gap_ms"]) for r in rows if r["mode"] == mode]
        ax.plot(*zip(*pts), style, label=f"{mode}: longest gap between tokens across the move")
    pts = [(r["prompt_len"], r["stop_copy_ms"]) for r in rows if r["mode"] == "live"]
    ax.plot(*zip(*pts), "^:", label="live: stop-and-copy (request paused)")
    pts = [(r["prompt_len"], r["itl_median_ms"]) for r in rows if r["mode"] == "live"]
    ax.plot(*zip(*pts), "x-", color="grey", label="median gap between tokens (no move)")
    ax.set_xlabel("prompt tokens (context when moved: + 16)")
    ax.set_ylabel("ms (log scale)")
    ax.set_yscale("log")
    ax.set_title("Moving a decoding request between two instances")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (and Ray CPUs) per instance")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=6.0)
    p.add_argument("--burstiness", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--downtime-lengths", default="64,256,1024,1792", help="prompt lengths for part 2 ('' skips it)"
    )
    p.add_argument("--repeats", type=int, default=3, help="moves per length and mode in part 2")
    p.add_argument("--plot", default=None, help="PNG of part 2")
    p.add_argument("--result-json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.num_prompts, a.prefix_len, a.output_len = 24, 128, 16
        a.downtime_lengths, a.repeats = "64,512", 1
    model = a.model or default_model_path()
    results: dict[str, Any] = {
        "command_line": shlex.join([sys.executable, *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "model": "default" if a.model is None else Path(model).name,
        "instances": a.instances,
        "threads_per_instance": a.threads,
        "trace": {
            k: getattr(a, k)
            for k in (
                "num_prompts",
                "num_prefixes",
                "prefix_len",
                "suffix_len",
                "output_len",
                "request_rate",
                "burstiness",
                "seed",
            )
        },
        "policies": {},
    }
    for policy in [x for x in a.policies.split(",") if x]:
        dispatch, _, migration = policy.partition("+")
        args = ["--num-instances", str(a.instances), "--num-threads", str(a.threads)]
        args += ["--dispatch-policy", dispatch, "--served-model-name", "m", "--max-num-seqs", "32"]
        if migration:
            args += ["--migration-triggers", "imbalance"]
        start = time.monotonic()
        with ServerProcess(model, *args, startup_timeout=600) as server:
            print(f"\n== {policy}: server up in {time.monotonic() - start:.0f}s", flush=True)
            result = run_bench(bench_args(server.url, "m", model, a))
            m = server.metrics()
            dispatched = [
                m.get(f'tandem:instance_requests_dispatched{{instance="{i}"}}', 0.0)
                for i in range(a.instances)
            ]
            results["policies"][policy] = {
                **summary(result),
                "dispatched": dispatched,
                "migrations": m.get('tandem:migrations_total{outcome="completed"}', 0.0),
            }
            server.stop()
    if results["policies"]:
        print_table(results)
    lengths = [int(x) for x in a.downtime_lengths.split(",") if x]
    if lengths:
        print("\n== migration cost against request length (2 engine processes)", flush=True)
        rows = asyncio.run(downtime_phase(model, lengths, a.repeats, a.threads))
        results["migration_cost"] = rows
        if a.plot:
            plot_downtime(rows, a.plot)
            print("plot:", a.plot)
    if a.result_json:
        Path(a.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(r: dict[str, Any]) -> None:
    cols = ["ttft_mean_ms", "ttft_p99_ms", "itl_p99_ms", "output_tok_s", "prefix_hit_rate", "preemptions"]
    cols += ["migrations"]
    print(f"\n{r['instances']} instances x {r['threads_per_instance']} thread(s), trace {r['trace']}")
    print(f"{'policy':<22}" + "".join(f"{c:>16}" for c in cols) + "  dispatched")
    for policy, row in r["policies"].items():
        cells = "".join(
            f"{row[c]:>16.2f}" if isinstance(row[c], (int, float)) else f"{'-':>16}" for c in cols
        )
        print(f"{policy:<22}{cells}  {row['dispatched']}")
    print("ran:", r["command_line"])


if __name__ == "__main__":
    raise SystemExit(main())
