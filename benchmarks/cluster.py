"""Dispatch and migration policies side by side, and what a live migration costs a request.

Part 1: for each policy (round_robin, least_load, prefix_aware, and least_load with live migration
on imbalance) a fresh `tandem serve --num-instances N` (Ray, `--threads` per instance) gets the
same trace from `tandem bench serve`'s client: Gamma arrivals (`--burstiness` < 1 is burstier than
Poisson), prompts from a few shared prefixes plus a distinct suffix, output lengths spread by
`--range-ratio`, greedy, `ignore_eos`. Prints TTFT mean/p99, ITL p99, output throughput,
prefix-cache hit rate, preemptions and migrations per policy.

Part 2: what a move costs the request moved, against its context. Three engine processes behind
one front end, one request at a time: it decodes on a source and, once 16 tokens have reached its
stream, moves to the third instance, with C tokens of context, in one of three ways:

- live: its KV is copied in stages while it keeps decoding (each stage the blocks filled since the
  last, the next stage only once the previous one landed), and it pauses only for what is left
  (the source runs the default `migration_max_stages` / `migration_stop_blocks`);
- stop-and-copy: the same transfer with no stage allowed (`migration_max_stages` 0): it pauses at
  once and all its KV is copied while it waits;
- recompute: it is resent; the destination recomputes its KV from the tokens so far.

For each move: the largest gap between two tokens its stream received from the move on, over its
median gap before the move (the ratio a client feels; ~1 is no hiccup), the stages copied while it
decoded, how long the source held it paused, the downtime as the front end measured it (last token
from the source to first from the destination) and the bytes sent. Plots the ratio and the gaps
against the context (`--plot`).

Every figure goes to JSON (`--result-json`).

    python benchmarks/cluster.py                       # default model, 2 instances x 1 thread
    python benchmarks/cluster.py --quick               # a smaller trace, fewer lengths, one move each
    python benchmarks/cluster.py --policies ''         # part 2 only
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


# -- part 2: one request moved: live, stop-and-copy, or by recompute ---------------------------

MODES = ("live", "stop-and-copy", "recompute")
# Instances of part 2: a source that copies in stages, one that may not (stop-and-copy), and the
# destination every move goes to.
LIVE_SOURCE, STOP_COPY_SOURCE, DESTINATION = 0, 1, 2
TOKENS_BEFORE_MOVE = 16
TOKENS_AFTER_MOVE = 32


async def move_one(client: Any, rid: str, prompt: list[int], mode: str, reports: list[Any]) -> dict[str, Any]:
    """Run one request, move it once `TOKENS_BEFORE_MOVE` tokens reached its stream; its gaps."""
    from tandem.kvtransfer.protocol import MoveOutcome
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=TOKENS_BEFORE_MOVE + TOKENS_AFTER_MOVE, ignore_eos=True
    )
    req, text = client.inputs.process(rid, {"prompt_token_ids": prompt}, params)
    notify = asyncio.Event()
    source = STOP_COPY_SOURCE if mode == "stop-and-copy" else LIVE_SOURCE
    stream = client.add(req, text, notify, instance=source)
    arrivals: list[float] = []  # when each token reached the stream
    before = len(reports)
    moved: int | None = None  # tokens the stream had when the move was asked for
    while True:
        await notify.wait()
        notify.clear()
        out = stream.take()
        if out is None:
            continue
        now = time.perf_counter()
        arrivals += [now] * (len(out.outputs[0].token_ids) - len(arrivals))
        if moved is None and len(arrivals) >= TOKENS_BEFORE_MOVE:
            moved = len(arrivals)
            ok = client.migrate_by_recompute(rid, DESTINATION) if mode == "recompute" else client.migrate_live(rid, DESTINATION)
            if not ok:
                raise RuntimeError(f"could not move {rid}")
        if out.finished:
            break
    if moved is None:
        raise RuntimeError(f"{rid} finished before its move")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    itl = statistics.median(gaps[: moved - 1])
    gap = max(gaps[moved - 1 :])
    row: dict[str, Any] = {
        "context_tokens": len(prompt) + moved,
        "gap_ms": gap * 1e3,
        "itl_median_ms": itl * 1e3,
        "gap_over_itl": gap / itl,
    }
    if mode != "recompute":
        (report,) = reports[before:]
        if report.outcome is not MoveOutcome.COMPLETED:
            raise RuntimeError(f"{mode} move of {rid}: {report.outcome.value} ({report.reason})")
        row.update(
            stages=report.num_stages,
            pause_ms=report.pause_s * 1e3,
            downtime_ms=None if report.downtime_s is None else report.downtime_s * 1e3,
            kv_bytes=report.num_bytes,
        )
    return row


async def downtime_phase(model: str, lengths: list[int], repeats: int, threads: int) -> list[dict[str, Any]]:
    """`lengths`: the context (prompt plus tokens so far) each request has when it moves."""
    from dataclasses import replace

    from tandem.config import EngineConfig
    from tandem.engine.connection import ProcessConnection
    from tandem.engine.core_client import AsyncEngineClient

    config = EngineConfig(
        model=model, num_threads=threads, max_num_seqs=8, max_model_len=max(lengths) + TOKENS_AFTER_MOVE + 64
    )
    configs = {LIVE_SOURCE: config, STOP_COPY_SOURCE: replace(config, migration_max_stages=0), DESTINATION: config}
    reports: list[Any] = []
    client = AsyncEngineClient(
        config,
        connections=[ProcessConnection(configs[i]) for i in range(3)],
        on_migrated=reports.append,
    )
    await client.start(timeout=600)
    rng = random.Random(0)
    rows = []
    try:
        vocab = client.limits.vocab_size
        for length in lengths:
            for mode in MODES:
                runs = []
                for rep in range(repeats + 1):  # the first is a warm-up
                    prompt = [rng.randrange(3, vocab) for _ in range(length - TOKENS_BEFORE_MOVE)]
                    r = await move_one(client, f"{mode}-{length}-{rep}", prompt, mode, reports)
                    if rep:
                        runs.append(r)
                row: dict[str, Any] = {"context_tokens": length, "mode": mode, "runs": runs}
                for key in ("gap_ms", "itl_median_ms", "gap_over_itl", "stages", "pause_ms", "downtime_ms", "kv_bytes"):
                    values = [x[key] for x in runs if x.get(key) is not None]
                    if values:
                        row[key] = statistics.median(values)
                row["gap_over_itl_max"] = max(x["gap_over_itl"] for x in runs)
                rows.append(row)
                line = f"  C={length:>5} {mode:<14} largest gap {row['gap_ms']:8.1f} ms = {row['gap_over_itl']:5.2f}x ITL"
                line += f" ({row['itl_median_ms']:.1f} ms)"
                if mode != "recompute":
                    line += f"  {row['stages']:.0f} stage(s), paused {row['pause_ms']:.2f} ms, {row['kv_bytes'] / 1e6:.2f} MB"
                print(line, flush=True)
    finally:
        await client.shutdown()
    return rows


def plot_downtime(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    styles = {"live": ("o", "-"), "stop-and-copy": ("^", "--"), "recompute": ("s", ":")}
    fig, (ratio, ms) = plt.subplots(1, 2, figsize=(11, 4.4))
    for mode, (marker, line) in styles.items():
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["context_tokens"])
        if not mine:
            continue
        x = [r["context_tokens"] for r in mine]
        # The median move, and a bar to the lowest and highest of the moves measured.
        for ax, key in ((ratio, "gap_over_itl"), (ms, "gap_ms")):
            mid = [r[key] for r in mine]
            lo = [m - min(run[key] for run in r["runs"]) for m, r in zip(mid, mine)]
            hi = [max(run[key] for run in r["runs"]) - m for m, r in zip(mid, mine)]
            label = mode if ax is ratio else f"{mode}: largest gap at the move"
            ax.errorbar(x, mid, yerr=[lo, hi], marker=marker, ls=line, capsize=3, label=label)
    ratio.axhline(2.0, color="grey", lw=0.8, ls="--", label="2x the usual gap")
    ratio.set_ylim(bottom=1.0)  # 1: no gap beyond the usual
    ratio.set_ylabel("largest gap at the move / median gap before")
    ratio.set_title("What the moved stream felt (median of the moves; bars: min-max)")
    live = sorted((r for r in rows if r["mode"] == "live"), key=lambda r: r["context_tokens"])
    if live:
        x = [r["context_tokens"] for r in live]
        ms.plot(x, [r["itl_median_ms"] for r in live], "x-", color="grey", label="median gap before the move")
    ms.set_ylabel("ms")
    ms.set_title("Gaps between tokens, as the stream received them")
    for ax in (ratio, ms):
        ax.set_xlabel("context tokens when moved")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
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
        "--downtime-lengths",
        default="256,512,1024,1800",
        help="context tokens at the move, for part 2 ('' skips it)",
    )
    p.add_argument("--repeats", type=int, default=3, help="moves per length and mode in part 2")
    p.add_argument("--plot", default=None, help="PNG of part 2")
    p.add_argument("--result-json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.num_prompts, a.prefix_len, a.output_len = 24, 128, 16
        a.downtime_lengths, a.repeats = "256,1024", 1
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
        print("\n== what a move costs the request moved, against its context (3 engine processes)", flush=True)
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
