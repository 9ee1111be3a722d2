"""`tandem simulate`: a trace through a simulated cluster, reported as `tandem bench serve` reports."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tandem.cluster.config import DISPATCH_POLICIES
from tandem.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig, field_default
from tandem.core.policy import SCHEDULING_POLICIES

# The step-time model used when --cost is not given: fitted on this project's machine.
DEFAULT_COST = Path(__file__).parent / "costs" / "default-amd-epyc-fp32-1thread.json"


def add_simulate_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="simulate a cluster on a trace with the real scheduling code")
    src = p.add_argument_group("trace")
    src.add_argument("--trace", default=None, help="Azure CSV, Mooncake JSONL or Tandem JSONL trace")
    src.add_argument("--num-requests", type=int, default=1000, help="synthetic trace (no --trace): requests")
    src.add_argument("--request-rate", type=float, default=10.0, help="synthetic: mean arrivals per second")
    src.add_argument("--burstiness", type=float, default=1.0, help="synthetic: Gamma shape (< 1: burstier)")
    src.add_argument("--prompt-len", default="64,1024", help="synthetic: min,max prompt tokens")
    src.add_argument("--output-len", default="16,256", help="synthetic: min,max output tokens")
    src.add_argument("--num-prefix-groups", type=int, default=0, help="synthetic: shared-prefix groups")
    src.add_argument("--prefix-len", type=int, default=0, help="synthetic: shared prefix tokens")
    src.add_argument("--rate-scale", type=float, default=1.0, help="compress arrivals by this factor")
    src.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    c = p.add_argument_group("cluster")
    c.add_argument("--instances", type=int, default=1, help="simulated engine instances")
    c.add_argument("--policy", default="least_load", choices=DISPATCH_POLICIES, help="dispatch policy")
    c.add_argument("--prefill-instances", type=int, default=0, help="disaggregation: prefill instances")
    c.add_argument("--decode-instances", type=int, default=0, help="disaggregation: decode instances")
    c.add_argument(
        "--pd-min-prompt-tokens", type=int, default=0, help="shorter prompts prefill on the decode instance"
    )
    c.add_argument(
        "--instances-per-host",
        type=int,
        default=1,
        help="instances sharing one machine (CPU instances): their steps slow each other down by the "
        "cost model's co-run penalty",
    )
    c.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="the front end refuses new requests (503, counted as failed) while this many have no token "
        "yet, as `tandem serve` does; 0: never",
    )
    c.add_argument("--migration-triggers", default="", help="imbalance,priority")
    c.add_argument(
        "--imbalance-threshold", type=float, default=0.2, help="load gap that fires the imbalance trigger"
    )
    i = p.add_argument_group("each instance")
    i.add_argument("--cost", default=str(DEFAULT_COST), help="step-time model JSON (tandem bench profile)")
    i.add_argument(
        "--replay-steps",
        default=None,
        metavar="FILE",
        help="time each instance's working steps by a real run's step trace (the engine's --step-trace: "
        "engines in the order of their first step), the rest by --cost: replay fidelity "
        "(tandem/sim/replay.py)",
    )
    i.add_argument("--num-kv-blocks", type=int, default=4096, help="KV-cache blocks per instance")
    # The knobs an instance shares with the engine default to the engine's (EngineConfig).
    for name, help_text in (
        ("block_size", "tokens per KV-cache block"),
        ("max_num_seqs", "sequences running at once"),
        ("max_num_batched_tokens", "token budget of one step"),
    ):
        flag = "--" + name.replace("_", "-")
        i.add_argument(flag, type=int, default=field_default(EngineConfig, name), help=help_text)
    i.add_argument("--max-model-len", type=int, default=8192, help="longest prompt + output")
    i.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    i.add_argument(
        "--scheduling-policy",
        default=field_default(EngineConfig, "scheduling_policy"),
        choices=SCHEDULING_POLICIES,
        help="which waiting request runs first",
    )
    i.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of the synthetic token ids")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="*", default=None, help="SLOs as KEY:ms, e.g. ttft:500 tpot:50")
    o.add_argument("--result-json", default=None, help="write the results here (JSON)")
    o.add_argument("--plot-dir", default=None, help="write PNG plots here")
    o.add_argument(
        "--step-trace",
        default=None,
        metavar="FILE",
        help="write every simulated step as the engine's --step-trace writes them (pid = instance)",
    )
    p.set_defaults(func=run_simulate)


def _pair(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{name} must be MIN,MAX (integers), got {text!r}") from None
    return lo, hi


def build(args: argparse.Namespace) -> Any:
    """The simulator for these arguments (not run)."""
    from tandem.cluster.config import ClusterConfig
    from tandem.core.policy import SchedulingConfig
    from tandem.sim.cost import load_cost
    from tandem.sim.instance import InstanceSpec
    from tandem.sim.replay import replay_costs
    from tandem.sim.simulator import ClusterSim
    from tandem.sim.trace import load_trace, scale_rate, synthetic

    if args.trace:
        trace = load_trace(args.trace)
    else:
        trace = synthetic(
            args.num_requests,
            args.request_rate,
            burstiness=args.burstiness,
            prompt_len=_pair(args.prompt_len, "--prompt-len"),
            output_len=_pair(args.output_len, "--output-len"),
            num_prefix_groups=args.num_prefix_groups,
            prefix_len=args.prefix_len,
            hash_block_tokens=args.block_size,
            seed=args.seed,
        )
    if args.max_waiting_requests < 0:
        raise ValueError(
            f"--max-waiting-requests must be 0 (no bound) or more, got {args.max_waiting_requests}"
        )
    if args.rate_scale != 1.0:
        trace = scale_rate(trace, args.rate_scale)
    disaggregated = args.prefill_instances > 0 or args.decode_instances > 0
    instances = args.prefill_instances + args.decode_instances if disaggregated else args.instances
    cluster = ClusterConfig(
        num_instances=instances,
        dispatch_policy=args.policy,
        migration_triggers=tuple(t for t in args.migration_triggers.split(",") if t),
        imbalance_threshold=args.imbalance_threshold,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        pd_min_prompt_tokens=args.pd_min_prompt_tokens,
    )
    spec = InstanceSpec(
        num_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling=SchedulingConfig(policy=args.scheduling_policy),
    )
    record = bool(getattr(args, "step_trace", None))
    cost = load_cost(args.cost)
    replay = getattr(args, "replay_steps", None)
    return ClusterSim(
        trace,
        cost,
        spec,
        cluster,
        instance_costs=list(replay_costs(cost, replay, instances)) if replay else None,
        vocab_size=args.vocab_size,
        record_steps=record,
        instances_per_host=args.instances_per_host,
        max_waiting_requests=args.max_waiting_requests or None,
    )


def write_step_trace(sim: Any, path: str) -> None:
    """The simulated steps of every instance, in the engine step trace's format."""
    from tandem.engine.step_trace import StepTrace

    Path(path).unlink(missing_ok=True)
    for inst in sim.instances:
        trace = StepTrace(path, pid=inst.index)
        for start, seconds, shape, waiting in inst.steps or []:
            trace.record(start, seconds, shape, waiting)
        trace.close()


def run_simulate(args: argparse.Namespace) -> int:
    from tandem.loadgen.latency_stats import parse_goodput
    from tandem.sim.report import format_summary, plot, summary

    sim = build(args)
    start = time.perf_counter()
    result = sim.run()
    wall = time.perf_counter() - start
    run = summary(result, parse_goodput(args.goodput))
    run["wall_s"] = wall
    run["trace"] = args.trace or "synthetic"
    run["cost_model"] = sim.cost.name
    print(format_summary(run))
    print(f"simulated {result.duration_s:.1f} s of serving in {wall:.1f} s ({len(result.records)} requests)")
    if args.step_trace:
        write_step_trace(sim, args.step_trace)
    if args.plot_dir:
        for path in plot(result, run, args.plot_dir):
            print("plot:", path)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(run, indent=2))
    return 0
