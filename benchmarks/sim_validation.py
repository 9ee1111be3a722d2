"""The simulator against real runs: the same trace served for real and simulated.

For each instance count (`--instances`, default 1 and 2) and each load level (`--rates`: light,
near capacity, overloaded), a synthetic trace is written to disk, replayed against `tandem serve`
(the default model, one thread per instance; 2 instances on Ray) by `tandem bench serve --dataset
trace`, and run through `tandem simulate` with the step-time model fitted on this machine and the
same instance settings. Prints throughput, mean and P99 TTFT and mean ITL, real against simulated,
with the relative error of each, and writes them as JSON.

    python benchmarks/sim_validation.py
    python benchmarks/sim_validation.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from tandem.entrypoints.llm import default_model_path
from tandem.loadgen.serve import add_serve_bench_args, run_bench
from tandem.loadgen.server_process import ServerProcess

METRICS = (
    ("output_throughput", "output tok/s"),
    ("ttft_mean", "TTFT mean ms"),
    ("ttft_p99", "TTFT p99 ms"),
    ("itl_mean", "ITL mean ms"),
)
INSTANCE = ["--num-kv-blocks", "2048", "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "512"]


def figures(run: dict[str, Any]) -> dict[str, float]:
    return {
        "output_throughput": run["output_throughput"],
        "ttft_mean": run["ttft_ms"]["mean"],
        "ttft_p99": run["ttft_ms"]["p99"],
        "itl_mean": run["itl_ms"]["mean"],
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def real(model: str, trace: str, instances: int, num: int, pin: bool = False) -> dict[str, float]:
    args = ["--num-threads", "1", "--served-model-name", "m", *INSTANCE, "--max-model-len", "2048"]
    if instances > 1:
        args += ["--num-instances", str(instances), "--dispatch-policy", "least_load"]
    with ServerProcess(model, *args, startup_timeout=600) as server:
        engine = server.engine_pid if instances == 1 else None
        if pin and engine is not None:  # the engine alone on CPU 0; front end and load generator on 1
            os.sched_setaffinity(engine, {0})
            os.sched_setaffinity(server.proc.pid, {1})
            os.sched_setaffinity(0, {1})
        cpu0 = {"api": cpu_seconds(server.proc.pid), "engine": cpu_seconds(engine) if engine else 0.0,
                "client": cpu_seconds(os.getpid())}
        p = argparse.ArgumentParser()
        add_serve_bench_args(p)
        argv = ["--base-url", server.url, "--model", "m", "--tokenizer", model, "--dataset", "trace"]
        argv += ["--dataset-path", trace, "--num-prompts", str(num), "--ignore-eos", "--disable-tqdm"]
        bench = p.parse_args([*argv, "--num-warmups", "0"])
        run = run_bench(bench)["runs"][0]
        cpu = {f"{k}_cpu_s": cpu_seconds(pid) - cpu0[k] for k, pid in
               (("api", server.proc.pid), ("client", os.getpid()), ("engine", engine)) if pid}
        view = engine_view(server.metrics())
        server.stop()
        if pin:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return {**figures(run), **view, **cpu, "duration_s": run["duration_s"]}


def engine_view(m: dict[str, float]) -> dict[str, float]:
    """The server's own means (its histograms, arrival = the API process took the request in):
    time to first token, queueing (to first scheduled) and prefill (first scheduled to first token),
    in ms. The client's TTFT minus `ttft_server_mean` is the HTTP and streaming share. Also the
    engines' steps and the seconds spent in them (busy time), to set against the simulator's."""
    out = {
        "engine_steps": m.get("tandem:engine_steps_total", float("nan")),
        "engine_busy_s": m.get("tandem:engine_step_seconds_total", float("nan")),
    }
    for key, name in (("ttft_server_mean", "time_to_first_token"), ("queue_mean", "request_queue_time"),
                      ("prefill_mean", "request_prefill_time")):
        count = m.get(f"tandem:{name}_seconds_count", 0.0)
        out[key] = 1e3 * m.get(f"tandem:{name}_seconds_sum", 0.0) / count if count else float("nan")
    return out


def simulated(trace: str, instances: int, cost: str | None) -> dict[str, float]:
    from tandem.entrypoints.cli import build_parser
    from tandem.sim.cli import build
    from tandem.sim.report import summary

    argv = ["simulate", "--trace", trace, "--instances", str(instances), "--policy", "least_load"]
    argv += ["--num-kv-blocks", "2048", "--block-size", "16", "--max-num-seqs", "32"]
    argv += ["--max-num-batched-tokens", "512", "--max-model-len", "2048", "--vocab-size", "4096"]
    if cost:
        argv += ["--cost", cost]
    sim = build(build_parser().parse_args(argv))
    result = sim.run()
    busy = sum(f * result.duration_s for f in result.busy_fraction)
    return {**figures(summary(result)), "engine_steps": result.steps, "engine_busy_s": busy}


def main(argv: list[str] | None = None) -> int:
    from tandem.sim.trace import save_trace, synthetic

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", default="1,2")
    p.add_argument("--rates", default="2,5,10", help="requests/s per instance: light, near capacity, overloaded")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--cost", default=None, help="step-time model (default: the shipped fit)")
    p.add_argument("--pin", action="store_true", help="one instance: engine on CPU 0, API process and client on 1")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--result-json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.instances, a.rates, a.num_requests = "1", "2,8", 40
    model = default_model_path()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.instances.split(",")]:
            for rate in [float(x) for x in a.rates.split(",")]:
                trace = synthetic(
                    a.num_requests, rate * n, burstiness=1.0, prompt_len=(32, 512), output_len=(16, 128), seed=7
                )
                path = str(Path(tmp) / f"trace-{n}-{rate}.jsonl")
                save_trace(trace, path)
                print(f"\n== {n} instance(s), {rate * n:g} req/s", flush=True)
                sim = simulated(path, n, a.cost)
                got = real(model, path, n, a.num_requests, a.pin)
                err = {k: (sim[k] - got[k]) / got[k] if got.get(k) else float("nan") for k in sim}
                rows.append({"instances": n, "rate": rate * n, "real": got, "simulated": sim, "error": err})
                for key, title in METRICS:
                    print(f"  {title:<14} real {got[key]:9.1f}  sim {sim[key]:9.1f}  error {err[key]:+7.1%}", flush=True)
                print(f"  server's view: TTFT {got['ttft_server_mean']:.1f} ms = queue {got['queue_mean']:.1f}"
                      f" + prefill {got['prefill_mean']:.1f}", flush=True)
                print(f"  engine steps real {got['engine_steps']:.0f} in {got['engine_busy_s']:.1f} s,"
                      f" sim {sim['engine_steps']:.0f} in {sim['engine_busy_s']:.1f} s", flush=True)
                cpu = ", ".join(f"{k.removesuffix('_cpu_s')} {v:.1f} s" for k, v in got.items() if k.endswith("_cpu_s"))
                print(f"  CPU time over the run of {got['duration_s']:.1f} s: {cpu}", flush=True)
    results = {
        "command_line": shlex.join([sys.executable, *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "rows": rows,
    }
    if a.result_json:
        Path(a.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
