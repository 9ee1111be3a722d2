"""Cluster policy studies at scale, in the simulator (docs/cluster_studies.md).

Four studies, each a table and a plot, all on the H200 + Llama-3-8B roofline step-time model
shipped in tandem/sim/costs (a model from spec numbers, not a measurement) and Tandem's own
scheduler, KV cache, prefix cache, dispatcher and rebalancer:

1. dispatch: round_robin / least_load / prefix_aware / least_load with imbalance migration, at 16
   and 64 instances, on a bursty mixed trace near capacity;
2. pd: the prefill:decode ratio at 16 instances against 16 colocated, on long prompts;
3. prefix: prefix-aware dispatch against cache-blind on a multi-tenant shared-prefix trace;
4. flood: one tenant floods one instance: fair share (tenant labels) against plain FCFS, and
   the starvation bound under priority scheduling.

    python benchmarks/cluster_studies.py                 # every study (long: tens of minutes)
    python benchmarks/cluster_studies.py --study flood --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.cluster.config import ClusterConfig
from tandem.core.policy import SchedulingConfig, TenantQuota
from tandem.sim.cost import load_cost
from tandem.sim.instance import InstanceSpec
from tandem.sim.report import summary
from tandem.sim.simulator import ClusterSim, SimResult
from tandem.sim.trace import Trace, synthetic

COST = Path(__file__).resolve().parent.parent / "tandem" / "sim" / "costs" / "h200-llama3-8b.json"
VOCAB = 128256
# One H200 serving Llama-3-8B in bf16: ~16 GB of weights, ~100 GB of the rest for KV at 128 KiB a
# token, i.e. ~50k blocks of 16 tokens.
SPEC = InstanceSpec(
    num_blocks=50_000, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=16384
)
# The SLO goodput counts against: interactive chat on an 8B model.
SLO = {"ttft": 2.0, "tpot": 0.1}  # seconds


def run(
    trace: Trace, instances: int, *, spec: InstanceSpec = SPEC, **cluster: Any
) -> tuple[dict[str, Any], ClusterSim, SimResult]:
    config = ClusterConfig(num_instances=instances, **cluster)
    # The engines' policies are what is studied: no front-end admission bound (a deployment
    # setting, `--max-waiting-requests`) refuses requests here.
    sim = ClusterSim(trace, load_cost(str(COST)), spec, config, vocab_size=VOCAB, max_waiting_requests=None)
    start = time.perf_counter()
    result = sim.run()
    figures = summary(result, SLO)
    figures["wall_s"] = round(time.perf_counter() - start, 1)
    hit = sum(i.scheduler.counters.prefix_cache_hits for i in sim.instances)
    query = sum(i.scheduler.counters.prefix_cache_queries for i in sim.instances)
    figures["prefix_hit_rate"] = hit / query if query else 0.0
    return figures, sim, result


def row(name: str, f: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": name,
        "throughput_tok_s": round(f["output_throughput"], 1),
        "goodput_req_s": round(f["goodput"]["request_goodput"], 2),
        "slo_met": round(f["goodput"]["good_requests"] / max(1, f["completed"]), 3),
        "ttft_mean_ms": round(f["ttft_ms"]["mean"], 1),
        "ttft_p99_ms": round(f["ttft_ms"]["p99"], 1),
        "tpot_mean_ms": round(f["tpot_ms"]["mean"], 2),
        "itl_p99_ms": round(f["itl_ms"]["p99"], 2),
        "preemptions": f["preemptions"],
        "migrations": f["migrations"],
        "prefix_hit_rate": round(f["prefix_hit_rate"], 3),
        "busy_fraction": round(f["busy_fraction_mean"], 3),
        "sim_wall_s": f["wall_s"],
    }


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"\n## {title}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in columns) + " |")


# -- the studies ---------------------------------------------------------------------------------


def mixed_trace(num: int, rate: float, seed: int = 1) -> Trace:
    """Bursty chat-like traffic: gamma arrivals of shape 0.25, heavy-tailed lengths, some shared
    system prompts (32 groups of 1024 tokens)."""
    return synthetic(
        num,
        rate,
        burstiness=0.25,
        prompt_len=(256, 4096),
        output_len=(32, 1024),
        num_prefix_groups=32,
        prefix_len=256,
        hash_block_tokens=SPEC.block_size,
        seed=seed,
    )


def study_dispatch(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": []}
    for instances in (16, 64):
        # One instance sustains ~25 requests/s of this mix within the SLO (see the doc): near capacity.
        per_instance = 22.0
        num = (30 if quick else 150) * instances
        trace = mixed_trace(num, per_instance * instances)
        for name, kw in (
            ("round_robin", {"dispatch_policy": "round_robin"}),
            ("least_load", {"dispatch_policy": "least_load"}),
            ("prefix_aware", {"dispatch_policy": "prefix_aware"}),
            (
                "least_load + migration",
                {"dispatch_policy": "least_load", "migration_triggers": ("imbalance",)},
            ),
        ):
            f, _, _ = run(trace, instances, **kw)
            out["rows"].append({"instances": instances, **row(name, f)})
            print(f"dispatch {instances} {name}: {out['rows'][-1]}", flush=True)
    return out


def study_pd(quick: bool) -> dict[str, Any]:
    instances = 16
    num = 60 * instances if quick else 200 * instances
    trace = synthetic(
        num,
        5.0 * instances,
        burstiness=0.5,
        prompt_len=(2048, 8192),
        output_len=(64, 512),
        hash_block_tokens=SPEC.block_size,
        seed=2,
    )
    out: dict[str, Any] = {"rows": []}
    configs: list[tuple[str, dict[str, Any]]] = [("16 colocated", {"dispatch_policy": "least_load"})]
    for p in (2, 4, 6, 8, 10):
        configs.append(
            (f"{p}P:{instances - p}D", {"prefill_instances": p, "decode_instances": instances - p})
        )
    for name, kw in configs:
        f, _, _ = run(trace, instances, **kw)
        out["rows"].append(row(name, f))
        print(f"pd {name}: {out['rows'][-1]}", flush=True)
    return out


def study_prefix(quick: bool) -> dict[str, Any]:
    instances = 16
    num = 60 * instances if quick else 250 * instances
    # 512 tenants, each with its own 4096-token system prompt, short questions and answers: all the
    # prefixes (131k blocks) fit in the cluster's caches (800k) but not in one instance's (50k).
    trace = synthetic(
        num,
        20.0 * instances,
        burstiness=0.5,
        prompt_len=(4160, 4608),
        output_len=(32, 256),
        num_prefix_groups=512,
        prefix_len=4096,
        hash_block_tokens=SPEC.block_size,
        seed=3,
    )
    out: dict[str, Any] = {"rows": []}
    for name in ("round_robin", "least_load", "prefix_aware"):
        f, sim, _ = run(trace, instances, dispatch_policy=name)
        r = row(name, f)
        busy = sim_busy(sim)
        r["busy_min"], r["busy_max"] = round(min(busy), 3), round(max(busy), 3)
        out["rows"].append(r)
        print(f"prefix {name}: {r}", flush=True)
    return out


def sim_busy(sim: ClusterSim) -> list[float]:
    end = max(sim.clock[0], 1e-9)
    return [i.busy_s / end for i in sim.instances]


def flood_trace(quick: bool, flood_priority: int = 0, steady_priority: int = 0) -> Trace:
    """Tenant "flood" sends 5x one instance's capacity for 60 s; tenant "steady" sends 10% of it
    throughout (120 s), both on the same instance."""
    span = 30.0 if quick else 60.0
    flood = synthetic(
        int(60 * span), 60.0, prompt_len=(512, 2048), output_len=(64, 512), hash_block_tokens=16, seed=4
    )
    steady = synthetic(
        int(1.2 * 2 * span), 1.2, prompt_len=(512, 2048), output_len=(64, 512), hash_block_tokens=16, seed=5
    )
    reqs = [replace(r, tenant="flood", priority=flood_priority) for r in flood.requests]
    reqs += [replace(r, tenant="steady", priority=steady_priority) for r in steady.requests]
    reqs.sort(key=lambda r: r.arrival_s)
    return Trace(reqs, hash_block_tokens=16, name="flood")


def per_tenant(trace: Trace, result: SimResult) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for tenant in ("flood", "steady"):
        recs = [r for r in result.records if trace.requests[r.index].tenant == tenant]
        ttft = sorted((r.first_token_s - r.arrival_s) for r in recs if r.first_token_s is not None)
        tokens = sum(len(r.token_times) for r in recs)
        out[tenant] = {
            "requests": len(recs),
            "ttft_mean_s": round(statistics.fmean(ttft), 2) if ttft else float("nan"),
            "ttft_max_s": round(ttft[-1], 2) if ttft else float("nan"),
            "output_tokens": tokens,
        }
    return out


def study_flood(quick: bool) -> dict[str, Any]:
    # A smaller instance so that one tenant's flood saturates it: an H200 limited to 32 sequences.
    spec = replace(SPEC, max_num_seqs=32, num_blocks=8192)
    out: dict[str, Any] = {"rows": []}

    def add(name: str, trace: Trace, scheduling: SchedulingConfig, strip_tenants: bool = False) -> None:
        t = Trace([replace(r, tenant=None) for r in trace.requests], 16, "blind") if strip_tenants else trace
        _, _, result = run(t, 1, spec=replace(spec, scheduling=scheduling))
        r = {
            "config": name,
            **{f"{k}_{m}": v for k, d in per_tenant(trace, result).items() for m, v in d.items()},
        }
        out["rows"].append(r)
        print(f"flood {name}: {r}", flush=True)

    trace = flood_trace(quick)
    add("fcfs, no tenant labels", trace, SchedulingConfig(), strip_tenants=True)
    add("fcfs, fair share (equal weights)", trace, SchedulingConfig())
    add(
        "fair share + flood max_running=16",
        trace,
        SchedulingConfig(tenants={"flood": TenantQuota(max_running=16)}),
    )
    # Priority: the flood is urgent (0), steady is background (1); without tenant labels fair share
    # is out of play, and only the starvation bound keeps the background tenant moving.
    ptrace = flood_trace(quick, flood_priority=0, steady_priority=1)
    for timeout in (5.0, 30.0, 1e9):
        add(
            f"priority, starvation {timeout:.0f} s" if timeout < 1e9 else "priority, no starvation bound",
            ptrace,
            SchedulingConfig(policy="priority", starvation_timeout_s=timeout),
            strip_tenants=True,
        )
    return out


STUDIES: dict[str, Callable[[bool], dict[str, Any]]] = {
    "dispatch": study_dispatch,
    "pd": study_pd,
    "prefix": study_prefix,
    "flood": study_flood,
}


def plot(name: str, data: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    path = out_dir / f"cluster_study_{name}.png"
    if name == "flood":
        fig, ax = plt.subplots(figsize=(9, 4.5))
        labels = [r["config"] for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["steady_ttft_mean_s"] for r in rows], 0.4, label="steady: mean TTFT")
        ax.bar([i + 0.2 for i in x], [r["steady_ttft_max_s"] for r in rows], 0.4, label="steady: max TTFT")
        ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title("One tenant floods an instance: the other tenant's time to first token")
        ax.legend()
    else:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.5))
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault(f"{r['instances']} instances" if "instances" in r else "", []).append(r)
        for ax, (metric, label) in zip(
            axes,
            (
                ("ttft_p99_ms", "TTFT p99 (ms)"),
                ("itl_p99_ms", "ITL p99 (ms)"),
                ("goodput_req_s", "goodput (req/s)"),
            ),
            strict=True,
        ):
            width = 0.8 / max(1, len(groups))
            for g, (gname, grows) in enumerate(groups.items()):
                xs = [i + g * width for i in range(len(grows))]
                ax.bar(xs, [r[metric] for r in grows], width, label=gname or None)
            first = next(iter(groups.values()))
            ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(first))])
            ax.set_xticklabels([r["config"] for r in first], rotation=25, ha="right", fontsize=8)
            ax.set_title(label)
            if len(groups) > 1:
                ax.legend(fontsize=8)
        fig.suptitle(f"Cluster study: {name} (simulated H200 + Llama-3-8B)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=[*STUDIES, "all"], default="all")
    p.add_argument("--quick", action="store_true", help="short traces (a smoke run, not the doc's figures)")
    p.add_argument("--out", default="benchmarks/results/cluster_studies.json")
    p.add_argument("--plot-dir", default="benchmarks/results")
    args = p.parse_args(argv)
    names = list(STUDIES) if args.study == "all" else [args.study]
    out_path = Path(args.out)
    results: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {}
    for name in names:
        data = STUDIES[name](args.quick)
        data["quick"] = args.quick
        data["date"] = time.strftime("%Y-%m-%d")
        data["host"] = platform.node()
        results[name] = data
        print_table(name, data["rows"], list(data["rows"][0]))
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        print("plot:", plot(name, data, Path(args.plot_dir)))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
