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


def _run_label(run: dict[str, Any]) -> str:
    rate = run.get("request_rate")
    return f"rate={'inf' if rate is None else rate} conc={run.get('max_concurrency')}"


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
            _cdf(ax, run.get(key, []), _run_label(run))
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
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["output_throughput"] for r in runs]
        for key, label in (("ttft_ms", "median TTFT"), ("tpot_ms", "median TPOT"), ("e2el_ms", "median E2E")):
            ax.plot(xs, [r[key]["median"] for r in runs], marker="o", label=label)
        for r, x in zip(runs, xs):
            ax.annotate(_run_label(r), (x, r["e2el_ms"]["median"]), fontsize=6)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = os.path.join(out_dir, "throughput_vs_latency.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
