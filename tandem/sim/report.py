"""What a simulation reports: the serving metrics `tandem bench serve` prints (the same summary
code), plus what only the simulator sees (preemptions, moves, KV usage over time, busy time)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from tandem.loadgen.latency_stats import RequestResult, finish_result, summarize
from tandem.loadgen.serve import format_table
from tandem.sim.simulator import SimResult


def client_results(result: SimResult) -> list[RequestResult]:
    """Each request as `tandem bench serve`'s client would have recorded it."""
    out = []
    for rec in result.records:
        r = RequestResult(prompt_len=rec.prompt_len, start=rec.arrival_s)
        if rec.finish_s is not None and rec.token_times:
            r.success = True
            r.chunk_times = [t - rec.arrival_s for t in rec.token_times]
            r.e2el = rec.finish_s - rec.arrival_s
            r.output_tokens = len(rec.token_times)
        else:
            r.error = "not finished"
        out.append(finish_result(r))
    return out


def summary(result: SimResult, slo: dict[str, float] | None = None) -> dict[str, Any]:
    run = summarize(client_results(result), result.duration_s, slo)
    usage = [u for _, per in result.usage_timeline for u in per]
    arrivals = [r.arrival_s for r in result.records]
    span = max(arrivals, default=0.0) - min(arrivals, default=0.0)
    run.update(
        request_rate=round(len(arrivals) / span, 3) if span > 0 else None,
        max_concurrency=None,
        num_instances=result.num_instances,
        preemptions=result.preemptions,
        migrations=result.migrations,
        migrations_aborted=result.migrations_aborted,
        handoffs=result.handoffs,
        kv_usage_mean=statistics.fmean(usage) if usage else 0.0,
        kv_usage_max=max(usage, default=0.0),
        busy_fraction_mean=statistics.fmean(result.busy_fraction) if result.busy_fraction else 0.0,
        steps=result.steps,
        refused=result.refused,
    )
    return run


def format_summary(run: dict[str, Any]) -> str:
    sim = {
        "instances": run["num_instances"],
        "refused (overloaded)": run["refused"],
        "preemptions": run["preemptions"],
        "migrations": run["migrations"],
        "migrations abandoned": run["migrations_aborted"],
        "prefill/decode hand-offs": run["handoffs"],
        "KV usage mean": run["kv_usage_mean"],
        "KV usage max": run["kv_usage_max"],
        "instance busy fraction": run["busy_fraction_mean"],
        "engine steps": run["steps"],
    }
    table = format_table({**run, "server_metrics": {}})
    width = max(len(k) for k in sim) + 2
    lines = [" Simulation ".center(width + 16, "-"), *[f"{k:<{width}}{v!s:>16.6}" for k, v in sim.items()]]
    return table + "\n" + "\n".join(lines)


def plot(result: SimResult, run: dict[str, Any], out_dir: str) -> list[str]:
    """KV usage over time (mean and busiest instance) and the TTFT / ITL distributions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    times = [t for t, _ in result.usage_timeline]
    a.plot(times, [statistics.fmean(u) for _, u in result.usage_timeline], label="mean over instances")
    a.plot(times, [max(u) for _, u in result.usage_timeline], label="busiest instance", alpha=0.7)
    a.set_xlabel("simulated time (s)")
    a.set_ylabel("KV cache usage")
    a.set_ylim(0, 1.05)
    a.legend()
    a.set_title(f"{result.num_instances} instances")
    ok = [r for r in client_results(result) if r.success]
    ttft = sorted(r.ttft * 1e3 for r in ok)
    itl = sorted(x * 1e3 for r in ok for x in r.itl)
    for values, label in ((ttft, "TTFT"), (itl, "ITL")):
        if values:
            b.plot(values, [i / len(values) for i in range(len(values))], label=label)
    b.set_xscale("log")
    b.set_xlabel("ms (log)")
    b.set_ylabel("fraction of requests / tokens")
    b.legend()
    b.set_title("latency CDF")
    fig.tight_layout()
    path = str(Path(out_dir) / "simulation.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
