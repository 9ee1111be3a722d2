"""PNG plots of `tandem bench serve` results (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values) * 1000.0)
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def run_label(run: dict[str, Any], short: bool = False) -> str:
    """What distinguishes a run: its request rate and/or its concurrency cap (unset ones left out)."""
    rate, conc = run.get("request_rate"), run.get("max_concurrency")
    parts = []
    if rate is not None:
        parts.append(f"{rate:g} req/s")
    if conc is not None:
        parts.append(f"c={conc}" if short else f"concurrency {conc}")
    return ", ".join(parts) or "all at once"


def plot_results(result: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    runs = result["runs"]
    for key, name in (("ttfts_s", "ttft"), ("itls_s", "itl")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            _cdf(ax, run.get(key, []), run_label(run))
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "ttft" else "tokens"))
        ax.set_title(f"{name.upper()} CDF — {result.get('label')}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = os.path.join(out_dir, f"{name}_cdf.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if len(runs) > 1:
        written.append(_throughput_vs_latency(result, runs, out_dir, plt))
    return written


def _throughput_vs_latency(result: dict[str, Any], runs: list[dict[str, Any]], out_dir: str, plt: Any) -> str:
    """Median TTFT, TPOT and E2E latency against output throughput, one point per run, each run's
    point labelled with its rate or concurrency."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = [r["output_throughput"] for r in runs]
    for key, label in (("e2el_ms", "median E2E latency"), ("ttft_ms", "median TTFT"), ("tpot_ms", "median TPOT")):
        ax.plot(xs, [r[key]["median"] for r in runs], marker="o", label=label)
    # Labels sit by the E2E points (the top line), alternately above and below so that close
    # points stay readable, pushed inwards at the plot's right edge.
    right = max(xs)
    for k, (r, x) in enumerate(zip(runs, xs)):
        at_right = x >= right - 1e-9
        ax.annotate(
            run_label(r, short=True),
            (x, r["e2el_ms"]["median"]),
            xytext=(-4 if at_right else 4, 7 if k % 2 == 0 else -12),
            textcoords="offset points",
            ha="right" if at_right else "left",
            fontsize=7,
        )
    ax.margins(x=0.08, y=0.25)
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title(f"Throughput vs latency — {result.get('label')}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", title="one point per run (c = max concurrency)", title_fontsize=7)
    path = os.path.join(out_dir, "throughput_vs_latency.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
