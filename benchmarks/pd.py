"""Prefill/decode disaggregation against colocation, on the workload it is meant for.

Part 1: a steady stream of decoding requests (`--decoders` clients in a closed loop, short prompts,
long outputs) while long prompts arrive every `--long-every` seconds. The same load goes to
`tandem serve --num-instances 2` (colocated: every instance prefills and decodes, least_load) and
to `tandem serve --prefill-instances 1 --decode-instances 1`, one thread per instance. Reports the
decoding requests' inter-token latency P50/P99 (what a long prefill stalls), the long prompts' TTFT
mean/P99, output throughput and the hand-offs' transfer time, side by side, as a ratio.

Part 2: where disaggregating a prompt stops paying. In one engine with `--decoders` requests
decoding, a step that also prefills L prompt tokens takes longer than a pure decode step: that
stall is what every decoding request pays when L is prefilled in place. A hand-off instead costs
the request a stop-and-copy (its KV's last blocks) on the decode side. Prints both against L; the
smallest L whose prefill stall exceeds the hand-off's is the measured `--pd-min-prompt-tokens`.

    python benchmarks/pd.py                 # default model
    python benchmarks/pd.py --quick         # shorter runs
    python benchmarks/pd.py --result-json benchmarks/results/pd.json

On a 2-core machine two instances of one thread each and the load generator share two cores, so
the prefill instance's work is not wholly off the decode instance's core: the gap it shows is a
lower bound of what separate machines give.
"""

from __future__ import annotations

import argparse
import asyncio
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
from tandem.loadgen.datasets import Sample
from tandem.loadgen.latency_stats import RequestResult
from tandem.loadgen.serve import send_request
from tandem.loadgen.server_process import ServerProcess

SETUPS = {
    "colocated": ["--num-instances", "2", "--dispatch-policy", "least_load"],
    "disaggregated": ["--prefill-instances", "1", "--decode-instances", "1"],
}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def text_of(tokenizer: Any, n: int, rng: random.Random) -> str:
    """A prompt of about `n` tokens (random ids, decoded)."""
    vocab = tokenizer.get_vocab_size()
    return tokenizer.decode([rng.randrange(10, vocab) for _ in range(n)])


async def load(url: str, a: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    try:  # the openai client ships with httpx2; plain httpx works the same
        import httpx2 as httpx
    except ImportError:
        import httpx  # type: ignore[no-redef]

    args = argparse.Namespace(
        model="m", temperature=0.0, ignore_eos=True, endpoint="completions", timeout=600, tokenizer=None
    )
    rng = random.Random(a.seed)
    decode_results: list[RequestResult] = []
    long_results: list[RequestResult] = []
    stop = time.perf_counter() + a.duration
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=256)) as client:

        async def decoder(i: int) -> None:
            while time.perf_counter() < stop:
                s = Sample(text_of(tokenizer, a.short_len, rng), a.short_len, a.decode_len)
                decode_results.append(await send_request(client, args, s))

        async def long_prompts() -> None:
            pending = []
            while time.perf_counter() < stop - a.long_every:
                await asyncio.sleep(a.long_every)
                s = Sample(text_of(tokenizer, a.long_len, rng), a.long_len, 8)
                pending.append(asyncio.create_task(send_request(client, args, s)))
            long_results.extend(await asyncio.gather(*pending))

        start = time.perf_counter()
        await asyncio.gather(*(decoder(i) for i in range(a.decoders)), long_prompts())
        elapsed = time.perf_counter() - start
    failed = [r.error for r in decode_results + long_results if not r.success]
    itl = [x for r in decode_results if r.success for x in r.itl]
    ttft = [r.ttft for r in long_results if r.success]
    tokens = sum(r.output_tokens for r in decode_results + long_results if r.success)
    return {
        "failed": len(failed),
        "errors": failed[:3],
        "decode_requests": len(decode_results),
        "long_requests": len(long_results),
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "long_ttft_mean_ms": statistics.fmean(ttft) * 1e3 if ttft else float("nan"),
        "long_ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "output_tok_s": tokens / elapsed,
    }


def part1(model: str, a: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    out: dict[str, Any] = {}
    for name, flags in SETUPS.items():
        args = [*flags, "--num-threads", "1", "--served-model-name", "m", "--max-num-seqs", "32"]
        args += ["--max-model-len", str(a.long_len + 256)]
        with ServerProcess(model, *args, startup_timeout=600) as server:
            print(f"\n== {name}", flush=True)
            row = asyncio.run(load(server.url, a, tokenizer))
            m = server.metrics()
            row["handoffs"] = m.get('tandem:migrations_total{outcome="completed"}', 0.0)
            count = m.get("tandem:kv_transfer_seconds_count", 0.0)
            row["transfer_mean_ms"] = (
                m.get("tandem:kv_transfer_seconds_sum", 0.0) / count * 1e3 if count else None
            )
            row["preemptions"] = m.get("tandem:num_preemptions_total", 0.0)
            out[name] = row
            print(json.dumps(row), flush=True)
            server.stop()
    return out


# -- part 2: the threshold -----------------------------------------------------------------


def part2(model: str, a: argparse.Namespace, lengths: list[int]) -> list[dict[str, Any]]:
    """Per prompt length: the extra time a decode step takes when it also prefills the prompt, and a
    hand-off's stop-and-copy between two engine processes."""
    from tandem.config import EngineConfig
    from tandem.engine.core import EngineCore
    from tandem.engine.messages import EngineCoreRequest
    from tandem.sampling_params import SamplingParams

    cfg = EngineConfig(model=model, num_threads=1, max_num_seqs=64, max_model_len=max(lengths) + 256)
    core = EngineCore(cfg)
    rng = random.Random(1)
    vocab = core.model_config.vocab_size
    budget = cfg.max_model_len - a.short_len  # type: ignore[operator]
    params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
    for i in range(a.decoders):
        prompt = [rng.randrange(10, vocab) for _ in range(a.short_len)]
        core.add_request(EngineCoreRequest(f"d{i}", prompt, params, budget, 0.0))
    for _ in range(3):  # everyone decoding
        core.step()

    def step_ms() -> float:
        start = time.perf_counter()
        core.step()
        return (time.perf_counter() - start) * 1e3

    rows = []
    handoff = asyncio.run(handoff_costs(model, lengths))
    for length in lengths:
        decode_only = statistics.median(step_ms() for _ in range(7))
        stalls = []
        for rep in range(5):
            prompt = [rng.randrange(10, vocab) for _ in range(length)]
            rid = f"p{length}-{rep}"
            core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=1), 1, 0.0))
            stalls.append(step_ms() - decode_only)  # the step that prefills it (one chunk)
        row = {
            "prompt_len": length,
            "decode_step_ms": decode_only,
            "prefill_stall_ms": statistics.median(stalls),
        }
        row.update(handoff[length])
        rows.append(row)
        print(
            f"  L={length:>5}  decode step {decode_only:6.1f} ms  +prefill {row['prefill_stall_ms']:7.1f} ms"
            f"   hand-off stop-and-copy {row['handoff_stop_copy_ms']:.2f} ms ({row['handoff_kv_bytes'] / 1e6:.2f} MB)",
            flush=True,
        )
    core.abort_requests([f"d{i}" for i in range(a.decoders)])
    return rows


async def handoff_costs(model: str, lengths: list[int]) -> dict[int, dict[str, float]]:
    from tandem.cluster.config import ClusterConfig
    from tandem.cluster.dispatch import Dispatcher
    from tandem.config import EngineConfig
    from tandem.engine.connection import ProcessConnection
    from tandem.engine.core_client import AsyncEngineClient, Disaggregation
    from tandem.kvtransfer.protocol import MoveOutcome
    from tandem.sampling_params import SamplingParams

    cfg = EngineConfig(model=model, num_threads=1, max_num_seqs=8, max_model_len=max(lengths) + 256)
    cluster = ClusterConfig(num_instances=2, prefill_instances=1, decode_instances=1)
    done: list[Any] = []
    client = AsyncEngineClient(
        cfg,
        connections=[ProcessConnection(cfg), ProcessConnection(cfg)],
        make_dispatcher=lambda r: Dispatcher(
            cluster, [x.limits.num_blocks for x in r], r[0].limits.block_size
        ),
        on_migrated=done.append,
        disaggregation=Disaggregation(frozenset({0}), frozenset({1})),
    )
    await client.start(timeout=600)
    rng = random.Random(2)
    out = {}
    try:
        assert client.inputs is not None and client.limits is not None
        for length in lengths:
            copies, sizes = [], []
            for rep in range(4):  # the first is a warm-up
                prompt = [rng.randrange(10, client.limits.vocab_size) for _ in range(length)]
                params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
                req, text = client.inputs.process(f"h{length}-{rep}", {"prompt_token_ids": prompt}, params)
                stream = client.add(req, text, asyncio.Event())
                while not stream.finished:
                    await asyncio.sleep(0.005)
                report = done[-1]
                if rep and report.outcome is MoveOutcome.COMPLETED:
                    copies.append(report.pause_s * 1e3)
                    sizes.append(report.num_bytes)
            out[length] = {
                "handoff_stop_copy_ms": statistics.median(copies),
                "handoff_kv_bytes": statistics.median(sizes),
            }
    finally:
        await client.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--decoders", type=int, default=6, help="closed-loop decoding clients")
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--decode-len", type=int, default=96)
    p.add_argument("--long-len", type=int, default=1536)
    p.add_argument("--long-every", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--threshold-lengths", default="8,16,32,64,128,256,512,1024")
    p.add_argument("--skip-load", action="store_true", help="part 2 only")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.long_len, a.threshold_lengths = 15.0, 512, "16,128,512"
    model = a.model or default_model_path()
    results: dict[str, Any] = {
        "command_line": shlex.join([sys.executable, *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "model": "default" if a.model is None else Path(model).name,
        "workload": {
            k: getattr(a, k)
            for k in ("decoders", "short_len", "decode_len", "long_len", "long_every", "duration")
        },
    }
    if not a.skip_load:
        runs = part1(model, a)
        results["load"] = runs
        c, d = runs["colocated"], runs["disaggregated"]
        print(f"\n{'':<16}{'colocated':>12}{'disagg':>12}{'disagg/colo':>13}")
        for key in ("itl_p50_ms", "itl_p99_ms", "long_ttft_mean_ms", "long_ttft_p99_ms", "output_tok_s"):
            print(f"{key:<16}{c[key]:>12.1f}{d[key]:>12.1f}{d[key] / c[key]:>13.2f}")
    lengths = [int(x) for x in a.threshold_lengths.split(",") if x]
    if lengths:
        print("\n== where disaggregating a prompt pays (prefill stall vs hand-off)", flush=True)
        rows = part2(model, a, lengths)
        results["threshold"] = rows
        pays = [r["prompt_len"] for r in rows if r["prefill_stall_ms"] > r["handoff_stop_copy_ms"]]
        results["measured_pd_min_prompt_tokens"] = min(pays) if pays else None
        print("measured --pd-min-prompt-tokens:", results["measured_pd_min_prompt_tokens"])
    if a.result_json:
        Path(a.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_json).write_text(json.dumps(results, indent=2))
    print("ran:", results["command_line"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
