"""The simulator against real runs: the same trace served for real and simulated.

For each instance count (`--instances`, default 1 and 2) and each load level (`--rates`: light,
near capacity, overloaded), a synthetic trace is written to disk, replayed against `tandem serve`
(the default model, one thread per instance; 2 instances on Ray) by `tandem bench serve --dataset
trace`, and run through `tandem simulate` with the step-time model fitted on this machine and the
same instance settings (several instances share one host, as they share this machine). The real
side runs `--repeats` times: the simulation is set against the runs' mean, and how far the runs
fall from it is printed beside (this VM's speed drifts between minutes; no simulator can land closer
than that). Prints throughput, mean and P99 TTFT and mean ITL, real against simulated, with the
relative error of each, and writes them as JSON. Each row is also simulated with a cost model fitted
on that row's real steps ("in-sample"): what is left then is the schedule's error, not the step
costs'.

With `--calibrate`, a calibration trace (other seeds) is served first and the cost model fitted on
its recorded steps; with `--calibration-rounds K` it is served K times, each round just before one
of the first K load levels' real runs, and the model is fitted on all rounds together, so its
steps come from across the minutes the real runs span. The simulations run once every level has
been served.

Both sides also write a per-step trace (the engine's `--step-trace`, the simulator's own), compared
as: steps, tokens per step, the engine loop's gap between consecutive busy steps (work the cost
model does not see: receiving requests, sending outputs) and, for the real steps, their recorded
time against what the cost model predicts for the same shapes.

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
from tandem.sim.profile import process_cpu_seconds

METRICS = (
    ("output_throughput", "output tok/s"),
    ("ttft_mean", "TTFT mean ms"),
    ("ttft_p99", "TTFT p99 ms"),
    ("itl_mean", "ITL mean ms"),
)
METRIC_KEYS = [key for key, _ in METRICS]
INSTANCE = ["--num-kv-blocks", "2048", "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "512"]


def figures(run: dict[str, Any]) -> dict[str, float]:
    return {
        "output_throughput": run["output_throughput"],
        "ttft_mean": run["ttft_ms"]["mean"],
        "ttft_p99": run["ttft_ms"]["p99"],
        "itl_mean": run["itl_ms"]["mean"],
    }


# Seconds between the calibration trace's load levels (an overloaded level's backlog drains first).
CALIBRATION_GAP_S = 10.0


def step_view(path: str, cost_path: str | None) -> dict[str, float]:
    """Steps of a step trace: how many, tokens per step, the loop's gap between busy steps, and
    the steps' recorded durations against the cost model's prediction for their shapes."""
    from tandem.engine.step_trace import line_shape, loop_gaps, read_step_trace
    from tandem.sim.cli import DEFAULT_COST
    from tandem.sim.cost import load_cost
    from tandem.sim.step_history import histories

    lines = read_step_trace(path) if Path(path).exists() else []
    if not lines:
        return {}
    cost = load_cost(cost_path or str(DEFAULT_COST))
    predicted = [cost.step_seconds(line_shape(line), h) for line, h in zip(lines, histories(lines))]
    busy_gaps = loop_gaps(lines)
    ratios = sorted(line["seconds"] / p for line, p in zip(lines, predicted) if p > 0)
    decode_only = [(line["seconds"], p) for line, p in zip(lines, predicted) if line["prefill_tokens"] == 0]
    with_prefill = [(line["seconds"], p) for line, p in zip(lines, predicted) if line["prefill_tokens"] > 0]
    n = len(lines)
    return {
        "trace_steps": n,
        "tokens_per_step": sum(line["prefill_tokens"] + line["decode_rows"] for line in lines) / n,
        "prefill_steps": len(with_prefill),
        "decode_rows_per_step": sum(line["decode_rows"] for line in lines) / n,
        "loop_gap_ms": 1e3 * sum(busy_gaps) / len(busy_gaps) if busy_gaps else 0.0,
        "loop_gap_total_s": sum(busy_gaps),
        "step_over_model": sum(line["seconds"] for line in lines) / sum(predicted),
        "step_over_model_median": ratios[len(ratios) // 2] if ratios else float("nan"),
        "decode_step_over_model": (sum(a for a, _ in decode_only) / sum(p for _, p in decode_only)
                                   if decode_only else float("nan")),
        "prefill_step_over_model": (sum(a for a, _ in with_prefill) / sum(p for _, p in with_prefill)
                                    if with_prefill else float("nan")),
    }


def real(model: str, trace: str, instances: int, num: int, pin: bool = False,
         step_trace: str | None = None, request_times: str | None = None, triggers: str = "",
         imbalance_threshold: float = 0.2) -> dict[str, float]:
    """One real run of `trace`; its figures. `request_times`: write what the client saw of each
    request there (JSON: the load generator's `request_times`)."""
    args = ["--num-threads", "1", "--served-model-name", "m", *INSTANCE, "--max-model-len", "2048"]
    if step_trace:
        args += ["--step-trace", step_trace]
    if instances > 1:
        args += ["--num-instances", str(instances), "--dispatch-policy", "least_load"]
        if triggers:
            args += ["--migration-triggers", triggers, "--imbalance-threshold", str(imbalance_threshold)]
    with ServerProcess(model, *args, startup_timeout=600) as server:
        engine = server.engine_pid if instances == 1 else None
        if pin and engine is not None:  # the engine alone on CPU 0; front end and load generator on 1
            os.sched_setaffinity(engine, {0})
            os.sched_setaffinity(server.proc.pid, {1})
            os.sched_setaffinity(0, {1})
        cpu0 = {"api": process_cpu_seconds(server.proc.pid), "engine": process_cpu_seconds(engine) if engine else 0.0,
                "client": process_cpu_seconds(os.getpid())}
        p = argparse.ArgumentParser()
        add_serve_bench_args(p)
        argv = ["--base-url", server.url, "--model", "m", "--tokenizer", model, "--dataset", "trace"]
        argv += ["--dataset-path", trace, "--num-prompts", str(num), "--ignore-eos", "--disable-tqdm"]
        bench = p.parse_args([*argv, "--num-warmups", "0", *(["--request-times"] if request_times else [])])
        run = run_bench(bench)["runs"][0]
        if request_times:
            Path(request_times).write_text(json.dumps(run.pop("request_times")))
        cpu = {f"{k}_cpu_s": process_cpu_seconds(pid) - cpu0[k] for k, pid in
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
        "migrations": sum(v for k, v in m.items()
                          if k.startswith("tandem:migrations_total{") and 'outcome="completed"' in k),
    }
    for key, name in (("ttft_server_mean", "time_to_first_token"), ("queue_mean", "request_queue_time"),
                      ("prefill_mean", "request_prefill_time")):
        count = m.get(f"tandem:{name}_seconds_count", 0.0)
        out[key] = 1e3 * m.get(f"tandem:{name}_seconds_sum", 0.0) / count if count else float("nan")
    return out


def simulated(trace: str, instances: int, cost: str | None, step_trace: str | None = None) -> dict[str, float]:
    """The trace through `tandem simulate` with the real run's settings; the instances share one host,
    as the real ones share this machine."""
    from tandem.entrypoints.cli import build_parser
    from tandem.sim.cli import build, write_step_trace
    from tandem.sim.report import summary

    argv = ["simulate", "--trace", trace, "--instances", str(instances), "--policy", "least_load"]
    argv += ["--instances-per-host", str(instances)]
    argv += ["--num-kv-blocks", "2048", "--block-size", "16", "--max-num-seqs", "32"]
    argv += ["--max-num-batched-tokens", "512", "--max-model-len", "2048", "--vocab-size", "4096"]
    if cost:
        argv += ["--cost", cost]
    if step_trace:
        argv += ["--step-trace", step_trace]
    sim = build(build_parser().parse_args(argv))
    result = sim.run()
    if step_trace:
        write_step_trace(sim, step_trace)
    busy = sum(f * result.duration_s for f in result.busy_fraction)
    return {**figures(summary(result)), "engine_steps": result.steps, "engine_busy_s": busy}


def replayed(
    trace: str, instances: int, cost: str | None, real_steps: list[str], triggers: str = "",
    imbalance_threshold: float = 0.2,
) -> list[dict[str, Any]]:
    """Replay fidelity: each real run replayed from its own records (its steps' durations, the
    loop's gaps, each request's way to its engine, when the front end placed and released each
    request, and its moves as recorded: tandem/sim/replay_run.py), request by request
    against that run. Engine side: each request's TTFT (the API process taking it in to the end
    of its first token's step) and mean ITL. Client side: what the client saw, with the replay's
    difference from the run's engine side added (the client's legs are the run's own)."""
    from tandem.cluster.config import ClusterConfig
    from tandem.engine.step_trace import front_end_events, move_lines, read_step_trace
    from tandem.sim.cli import DEFAULT_COST
    from tandem.sim.cost import load_cost
    from tandem.sim.instance import InstanceSpec
    from tandem.sim.replay_run import replay_served_run
    from tandem.sim.trace import load_trace

    spec = InstanceSpec(2048, 16, 32, 512, 2048)
    cluster = ClusterConfig(
        num_instances=instances,
        dispatch_policy="least_load",
        migration_triggers=tuple(t for t in triggers.split(",") if t),
        imbalance_threshold=imbalance_threshold,
    )
    base = load_cost(cost or str(DEFAULT_COST))
    out = []
    for steps in real_steps:
        report = replay_served_run(
            load_trace(trace), read_step_trace(steps), spec, cluster, base, 4096, front_end_events(steps),
            move_lines(steps),
        )
        row: dict[str, Any] = {"engine_side": report.summary(), "replay_migrations": report.result.migrations}
        client_path = Path(steps).with_suffix(".requests.json")
        if client_path.exists():
            row["client_side"] = client_side(report, json.loads(client_path.read_text()))
        row["first_divergence"] = [None if d is None else [d[0], str(d[1]), str(d[2])]
                                   for d in report.first_divergence]
        # The first act of a move the replay did otherwise than the run (kind, step, blocks).
        row["first_act_apart"] = next(
            ([d.move, d.kind, d.step, d.blocks, d.recorded.kind, d.recorded.step, d.recorded.blocks]
             for d in report.acts if not d.alike), None)
        out.append(row)
    return out


def client_side(report: Any, client: list[dict[str, Any]]) -> dict[str, float]:
    """The client's per-request TTFT and mean ITL (first to last content chunk over the tokens
    between), against the same with the replay's engine-side difference from the run added."""
    seen = {c["id"] + "-0": c for c in client if c["id"] and c["chunk_times"]}
    ttft, itl, ttft_real, ttft_rep, itl_real, itl_rep = [], [], [], [], [], []
    for r in report.requests:
        c = seen.get(r.request_id)
        if c is None:
            continue
        t = c["chunk_times"][0]
        t_rep = t + (r.ttft_replay - r.ttft)
        ttft.append(abs(t_rep - t) / t)
        ttft_real.append(t)
        ttft_rep.append(t_rep)
        n = c["output_tokens"]
        if n > 1 and r.itl is not None and r.itl_replay is not None:
            i = (c["chunk_times"][-1] - t) / (n - 1)
            i_rep = i + (r.itl_replay - r.itl)
            if i > 0:
                itl.append(abs(i_rep - i) / i)
                itl_real.append(i)
                itl_rep.append(i_rep)

    def p99(xs: list[float]) -> float:
        return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")

    return {
        "requests": len(ttft),
        "ttft_error_mean": sum(ttft) / len(ttft) if ttft else float("nan"),
        "ttft_error_p99": p99(ttft),
        "itl_error_mean": sum(itl) / len(itl) if itl else float("nan"),
        "itl_error_p99": p99(itl),
        "ttft_mean_error": (sum(ttft_rep) - sum(ttft_real)) / sum(ttft_real) if ttft_real else float("nan"),
        "itl_mean_error": (sum(itl_rep) - sum(itl_real)) / sum(itl_real) if itl_real else float("nan"),
    }


def in_sample(trace: str, instances: int, real_steps: list[str], cost: str | None, tmp: str) -> dict[str, float]:
    """The simulation with a cost model fitted on the real run's own steps: not a prediction, but
    what is left when the step costs are right (the schedule's fidelity). With several instances on
    this machine, the steps alone stay the given model's and the run's own steps fit the co-run
    penalty and the loop gap."""
    from tandem.sim.calibrate import calibrate, calibrate_co_run
    from tandem.sim.cli import DEFAULT_COST
    from tandem.sim.cost import FittedCost, load_cost, save_cost

    base = load_cost(cost or str(DEFAULT_COST))
    if not isinstance(base, FittedCost):
        return {}
    path = str(Path(tmp) / "in-sample-cost.json")
    save_cost(calibrate(real_steps, base) if instances == 1 else calibrate_co_run(real_steps, base), path)
    return simulated(trace, instances, path)


def workload(num: int, rate: float, seed: int) -> Any:
    """The validation's synthetic trace shape (Poisson arrivals, prompts 32-512, outputs 16-128)."""
    from tandem.sim.trace import synthetic

    return synthetic(num, rate, burstiness=1.0, prompt_len=(32, 512), output_len=(16, 128), seed=seed)


def serve_calibration(model: str, a: argparse.Namespace, instances: int, tmp: str, round_: int = 0) -> str:
    """Serve a calibration trace on `instances` instances with a step trace; the trace's path. The
    trace (seeds 11 on, not the validation traces') runs each load level in turn,
    `--calibration-requests` at each (default: as many as a validation run), so the fit sees the
    batch shapes of light load and of an overloaded engine alike: fitted near capacity only, a linear
    model extrapolates badly to 32-row decode steps, and with a third of the requests at each level
    the overloaded stretch was too short to hold the full-batch decode steps that are most of an
    overloaded run's time. Each round (`round_`) draws its own requests."""
    from dataclasses import replace

    from tandem.sim.trace import Trace, save_trace

    rates = [float(x) * instances for x in a.rates.split(",")]
    per = max(1, a.calibration_requests or a.num_requests)
    requests, start = [], 0.0
    for i, rate in enumerate(rates):
        part = workload(per, rate, seed=11 + i + 100 * round_)
        requests += [replace(r, arrival_s=r.arrival_s + start) for r in part.requests]
        # The next level starts once this one's backlog has had time to drain.
        start = requests[-1].arrival_s + CALIBRATION_GAP_S
    path = str(Path(tmp) / f"calibration-{instances}-{round_}.jsonl")
    steps = str(Path(a.step_trace_dir or tmp) / f"calibration-steps-{instances}-{round_}.jsonl")
    Path(steps).parent.mkdir(parents=True, exist_ok=True)
    Path(steps).unlink(missing_ok=True)
    save_trace(Trace(requests, hash_block_tokens=16, name="calibration"), path)
    levels = ", ".join(f"{r:g}" for r in rates)
    print(f"\n== calibration run {round_ + 1}: {instances} instance(s), {per} requests at each of {levels} req/s",
          flush=True)
    real(model, path, instances, len(requests), a.pin, steps)
    return steps


def fit_calibration(
    steps: list[str], base_cost: str | None, instances: int, out_dir: str, alone: str | None = None
) -> str:
    """The cost model fitted on the calibration runs' steps (all rounds together); its path. One
    instance fits the steps of an engine alone on this machine; several (`alone`: the one-instance
    fit) fit how much their steps slow each other down on its two cores (`calibrate_co_run`), the
    steps themselves staying `alone`'s."""
    from tandem.sim.calibrate import calibrate, calibrate_co_run, load_base
    from tandem.sim.cost import FittedCost, load_cost, save_cost

    if instances == 1:
        fitted = calibrate(steps, load_base(base_cost))
    else:
        one = load_cost(alone) if alone else None
        if not isinstance(one, FittedCost):
            raise ValueError("several instances calibrate on a fitted one-instance model")
        fitted = calibrate_co_run(steps, one)
    out = str(Path(out_dir) / f"calibrated-cost-{instances}.json")
    save_cost(fitted, out)
    err = fitted.fit_error
    coef = ", ".join(f"{k} {v:.3g}" for k, v in fitted.coefficients.items())
    print(f"\n== cost model for {instances} instance(s) from {len(steps)} calibration run(s): fitted on "
          f"{fitted.meta.get('steps_fitted')} served steps: {coef}"
          + (f"; held-out error mean {err.mape:.1f}%, P90 {err.p90:.1f}%" if err else "")
          + f"; loop gap {fitted.loop_gap_s * 1e3:.2f} ms, ingress {fitted.ingress_s * 1e3:.2f} ms,"
          f" delivery {fitted.delivery_s * 1e3:.2f} ms, co-run penalty {fitted.co_run_penalty:.3f}", flush=True)
    return out


def compare(n: int, rate: float, path: str, real_steps: list[str], runs: list[dict[str, float]],
            cost: str | None, keep: Path, tmp: str, replay: bool = False, triggers: str = "",
            imbalance_threshold: float = 0.2) -> dict[str, Any]:
    """One row: the level's real runs against its simulation (and the in-sample one), printed; the
    row's JSON."""
    print(f"\n== {n} instance(s), {rate * n:g} req/s", flush=True)
    sim_steps = str(keep / f"sim-{n}-{rate:g}.jsonl")
    Path(sim_steps).unlink(missing_ok=True)
    sim = simulated(path, n, cost, sim_steps)
    got = {k: sum(run[k] for run in runs) / len(runs) for k in runs[0]}
    # How far the real runs of one trace fall from their own mean: the floor under any error.
    spread = {k: max(abs(run[k] - got[k]) / got[k] for run in runs) for k in METRIC_KEYS if got[k]}
    err = {k: (sim[k] - got[k]) / got[k] if got.get(k) else float("nan") for k in METRIC_KEYS}
    steps = {"real": step_view(real_steps[0], cost), "simulated": step_view(sim_steps, cost)}
    own = in_sample(path, n, real_steps, cost, tmp)
    own_err = {k: (own[k] - got[k]) / got[k] if got.get(k) else float("nan") for k in METRIC_KEYS}
    replays = replayed(path, n, cost, real_steps, triggers, imbalance_threshold) if replay else []
    for key, title in METRICS:
        print(f"  {title:<14} real {got[key]:9.1f} (runs within {spread.get(key, 0):5.1%})  sim {sim[key]:9.1f}"
              f"  error {err[key]:+7.1%}", flush=True)
    print(f"  server's view: TTFT {got['ttft_server_mean']:.1f} ms = queue {got['queue_mean']:.1f}"
          f" + prefill {got['prefill_mean']:.1f}", flush=True)
    print(f"  engine steps real {got['engine_steps']:.0f} in {got['engine_busy_s']:.1f} s,"
          f" sim {sim['engine_steps']:.0f} in {sim['engine_busy_s']:.1f} s", flush=True)
    cpu = ", ".join(f"{k.removesuffix('_cpu_s')} {v:.1f} s" for k, v in got.items() if k.endswith("_cpu_s"))
    print(f"  CPU time over the run of {got['duration_s']:.1f} s: {cpu}", flush=True)
    print("  in-sample (cost fitted on this run's own steps): "
          + ", ".join(f"{title} {own_err[key]:+.1%}" for key, title in METRICS), flush=True)
    for i, rp in enumerate(replays):
        e = rp["engine_side"]
        print(f"  replay of run {i + 1} (its own records), per request |error| mean / P99: TTFT "
              f"{e['ttft_error_mean']:.2%} / {e['ttft_error_p99']:.2%}, ITL {e['itl_error_mean']:.2%} /"
              f" {e['itl_error_p99']:.2%}; mean TTFT {e['ttft_mean_error']:+.2%}, mean ITL {e['itl_mean_error']:+.2%};"
              f" {e['requests_within_2pct']} of {e['requests']} requests within 2%; steps of another shape"
              f" {e['steps_of_another_shape']} of {e['steps']}, unrecorded {e['unrecorded_steps']},"
              f" placed elsewhere {e['placed_elsewhere']}; moves real {runs[i].get('migrations', 0):.0f},"
              f" replayed {rp['replay_migrations']}; move acts alike {e['move_acts_alike']} of {e['move_acts']}"
              f" (stages {e['stages_run']} / {e['stages_replay']}, pauses {e['pauses_run']} /"
              f" {e['pauses_replay']})", flush=True)
        if "client_side" in rp:
            c = rp["client_side"]
            print(f"    client side: TTFT {c['ttft_error_mean']:.2%} / {c['ttft_error_p99']:.2%}, ITL "
                  f"{c['itl_error_mean']:.2%} / {c['itl_error_p99']:.2%} over {c['requests']} requests", flush=True)
    rs, ss = steps["real"], steps["simulated"]
    if rs and ss:
        print(f"  steps real / sim: {rs['trace_steps']} / {ss['trace_steps']}, tokens per step "
              f"{rs['tokens_per_step']:.1f} / {ss['tokens_per_step']:.1f}, decode rows per step "
              f"{rs['decode_rows_per_step']:.1f} / {ss['decode_rows_per_step']:.1f}, steps with prefill "
              f"{rs['prefill_steps']} / {ss['prefill_steps']}", flush=True)
        print(f"  real steps: loop gap {rs['loop_gap_ms']:.2f} ms per step ({rs['loop_gap_total_s']:.1f} s),"
              f" measured / cost model {rs['step_over_model']:.2f} (median {rs['step_over_model_median']:.2f};"
              f" decode-only {rs['decode_step_over_model']:.2f}, with prefill "
              f"{rs['prefill_step_over_model']:.2f})", flush=True)
    return {"instances": n, "rate": rate * n, "real": got, "real_runs": runs, "real_spread": spread,
            "simulated": sim, "error": err, "steps": steps, "simulated_in_sample": own, "error_in_sample": own_err,
            "replay": replays}


def main(argv: list[str] | None = None) -> int:
    from tandem.sim.cli import DEFAULT_COST
    from tandem.sim.cost import SERVING_FIELDS, load_cost
    from tandem.sim.trace import save_trace

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", default="1,2")
    p.add_argument("--rates", default="2,5,10", help="requests/s per instance: light, near capacity, overloaded")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--cost", default=None, help="step-time model (default: the shipped fit)")
    p.add_argument("--pin", action="store_true", help="one instance: engine on CPU 0, API process and client on 1")
    p.add_argument("--repeats", type=int, default=3, help="real runs per load level (the mean is compared)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--result-json", default=None)
    p.add_argument("--step-trace-dir", default=None, help="keep both sides' step traces here")
    p.add_argument(
        "--replay",
        action="store_true",
        help="also replay each real run from its own records (step durations, loop gaps, each request's "
        "way to its engine: tandem/sim/replay_run.py) and compare it with that run request by request",
    )
    p.add_argument(
        "--migration-triggers",
        default="",
        help="several instances: the server's --migration-triggers (imbalance, priority) for the real "
        "runs, and the replay's (the simulated ones stay without)",
    )
    p.add_argument("--imbalance-threshold", type=float, default=0.2, help="with --migration-triggers imbalance")
    p.add_argument(
        "--alone-cost",
        default=None,
        help="with --calibrate and several instances: the one-instance calibrated model they build on "
        "(calibrated-cost-1.json of an earlier run's --step-trace-dir; default: calibrate one instance first)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="first serve a separate calibration trace (another seed, the middle rate) and fit the cost "
        "model on its recorded steps (`tandem bench profile --from-step-trace`); simulate with that",
    )
    p.add_argument(
        "--calibration-requests",
        type=int,
        default=None,
        help="with --calibrate: requests at each load level of the calibration trace (default: --num-requests)",
    )
    p.add_argument(
        "--calibration-rounds",
        type=int,
        default=1,
        help="with --calibrate: serve the calibration trace this many times, one round before each of "
        "the first load levels' real runs (new requests each round), and fit on all of them together",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.instances, a.rates, a.num_requests, a.repeats = "1", "2,8", 40, 1
    if a.calibration_rounds < 1:
        p.error("--calibration-rounds must be at least 1")
    model = default_model_path()
    rows = []
    base_cost = a.cost
    costs_used = {}
    alone = a.alone_cost  # the one-instance calibration, which several instances build on
    rates = [float(x) for x in a.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        keep = Path(a.step_trace_dir or tmp)
        keep.mkdir(parents=True, exist_ok=True)
        for n in [int(x) for x in a.instances.split(",")]:
            if a.calibrate and n > 1 and alone is None:
                alone_steps = [serve_calibration(model, a, 1, tmp, r) for r in range(a.calibration_rounds)]
                alone = fit_calibration(alone_steps, base_cost, 1, str(keep))
            calibration_steps: list[str] = []
            served = []
            for i, rate in enumerate(rates):
                if a.calibrate and i < a.calibration_rounds:
                    calibration_steps.append(serve_calibration(model, a, n, tmp, i))
                trace = workload(a.num_requests, rate * n, seed=7)
                path = str(Path(tmp) / f"trace-{n}-{rate}.jsonl")
                save_trace(trace, path)
                print(f"\n== {n} instance(s), {rate * n:g} req/s: {a.repeats} real run(s)", flush=True)
                real_steps = [str(keep / f"real-{n}-{rate:g}-{r}.jsonl") for r in range(a.repeats)]
                for old in real_steps:
                    Path(old).unlink(missing_ok=True)
                runs = [real(model, path, n, a.num_requests, a.pin, steps,
                             str(Path(steps).with_suffix(".requests.json")) if a.replay else None,
                             a.migration_triggers if n > 1 else "", a.imbalance_threshold)
                        for steps in real_steps]
                served.append((rate, path, real_steps, runs))
            for r in range(len(calibration_steps), a.calibration_rounds if a.calibrate else 0):
                calibration_steps.append(serve_calibration(model, a, n, tmp, r))
            if a.calibrate:
                a.cost = fit_calibration(calibration_steps, base_cost, n, str(keep), alone)
                if n == 1:
                    alone = a.cost
            cost_used = load_cost(a.cost or str(DEFAULT_COST)).to_dict()
            keys = ("name", "coefficients", "fit_error", *SERVING_FIELDS, "meta")
            costs_used[n] = {k: cost_used[k] for k in keys if k in cost_used}
            for rate, path, real_steps, runs in served:
                rows.append(compare(n, rate, path, real_steps, runs, a.cost, keep, tmp, a.replay,
                                    a.migration_triggers if n > 1 else "", a.imbalance_threshold))
    results = {
        "command_line": shlex.join(["python", *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "cost_model": costs_used,
        "rows": rows,
    }
    if a.result_json:
        Path(a.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
