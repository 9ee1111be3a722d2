"""Dispatch policies side by side: one bursty trace through N instances under each policy.

For each policy (round_robin, least_load, prefix_aware) a fresh `tandem serve --num-instances N`
(Ray, `--threads` per instance) gets the same trace from `tandem bench serve`'s client: Gamma
arrivals (`--burstiness` < 1 is burstier than Poisson), prompts from a few shared prefixes plus a
distinct suffix, output lengths spread by `--range-ratio`, greedy, `ignore_eos`. Prints TTFT
mean/p99, ITL p99, output throughput, prefix-cache hit rate and preemptions per policy, and writes
every figure as JSON.

    python benchmarks/cluster.py                       # default model, 2 instances x 1 thread
    python benchmarks/cluster.py --quick               # a smaller trace
    python benchmarks/cluster.py --model PATH --instances 3 --result-json out.json

On a 2-core machine, 2 instances of one thread each use the whole machine and the client shares
it: the figures compare policies against each other, not against a bigger machine. Live
migration is not built yet, so it has no row here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from tandem.entrypoints.llm import default_model_path
from tandem.loadgen.serve import add_serve_bench_args, run_bench
from tandem.loadgen.server_process import ServerProcess

POLICIES = ("round_robin", "least_load", "prefix_aware")


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
    p.add_argument("--result-json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.num_prompts, a.prefix_len, a.output_len = 24, 128, 16
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
    for policy in a.policies.split(","):
        args = ["--num-instances", str(a.instances), "--num-threads", str(a.threads)]
        args += ["--dispatch-policy", policy, "--served-model-name", "m", "--max-num-seqs", "32"]
        start = time.monotonic()
        with ServerProcess(model, *args, startup_timeout=600) as server:
            print(f"\n== {policy}: server up in {time.monotonic() - start:.0f}s", flush=True)
            result = run_bench(bench_args(server.url, "m", model, a))
            m = server.metrics()
            dispatched = [
                m.get(f'tandem:instance_requests_dispatched{{instance="{i}"}}', 0.0)
                for i in range(a.instances)
            ]
            results["policies"][policy] = {**summary(result), "dispatched": dispatched}
            server.stop()
    print_table(results)
    if a.result_json:
        Path(a.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(r: dict[str, Any]) -> None:
    cols = ["ttft_mean_ms", "ttft_p99_ms", "itl_p99_ms", "output_tok_s", "prefix_hit_rate", "preemptions"]
    print(f"\n{r['instances']} instances x {r['threads_per_instance']} thread(s), trace {r['trace']}")
    print(f"{'policy':<14}" + "".join(f"{c:>16}" for c in cols) + "  dispatched")
    for policy, row in r["policies"].items():
        cells = "".join(
            f"{row[c]:>16.2f}" if isinstance(row[c], (int, float)) else f"{'-':>16}" for c in cols
        )
        print(f"{policy:<14}{cells}  {row['dispatched']}")
    print("ran:", r["command_line"])


if __name__ == "__main__":
    raise SystemExit(main())
