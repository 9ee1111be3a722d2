"""`tandem bench serve`: drive an OpenAI-compatible server with streaming requests, measure client-side."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from tandem.loadgen.arrivals import arrival_intervals
from tandem.loadgen.datasets import Sample, add_dataset_args, build_dataset, load_tokenizer
from tandem.loadgen.latency_stats import RequestResult, finish_result, parse_goodput, summarize
from tandem.loadgen.plot import run_label
from tandem.loadgen.server_counters import counter_deltas, parse_prometheus, server_counters


def _float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    g.add_argument(
        "--model", default=None, help="model name to send (unset: the first one the server's /v1/models lists)"
    )
    g.add_argument(
        "--endpoint", default="completions", choices=["completions", "chat"], help="/v1/completions or /v1/chat/completions"
    )
    g.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder to build prompts of exact lengths")
    add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=_float_list,
        default=[math.inf],
        help="requests/s (inf = all at once); a comma list runs each",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; gamma shape otherwise")
    g.add_argument(
        "--max-concurrency", type=_float_list, default=None, help="in-flight cap; a comma list runs each"
    )
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate every output token")
    g.add_argument(
        "--send-token-ids",
        action="store_true",
        help="send the prompts as token ids (needs --tokenizer): every server prefills the same tokens",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent first, not in the results")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    g.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    g = p.add_argument_group("output")
    g.add_argument("--result-json", default=None, help="write the results here (JSON)")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    g.add_argument("--label", default=None, help="name of this system in the results")
    g.add_argument(
        "--request-times",
        action="store_true",
        help="also keep each request's server id, send time (time.monotonic()) and content chunk "
        "times in the results (`request_times`): a replay of the run sets its own against them",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _payload(args: argparse.Namespace, s: Sample) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": s.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": s.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = s.prompt_token_ids if s.send_ids else s.prompt
    return "/v1/completions", body


def _chunk_text(data: dict[str, Any]) -> str:
    text = ""
    for c in data.get("choices") or []:
        if "text" in c:
            text += c.get("text") or ""
        delta = c.get("delta") or {}
        text += delta.get("content") or delta.get("reasoning_content") or ""
    return text


async def _sse_data(content: Any) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream (an aiohttp response's content), up to
    `[DONE]`. Whole chunks are split into lines here: aiohttp's own line reader refuses lines past
    its buffer size, and an event with logprobs can be long."""
    pending = b""
    async for chunk in content.iter_any():
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield payload
    last = pending.strip()  # a stream that ends without its final newline
    if last.startswith(b"data:") and last[5:].strip() != b"[DONE]":
        yield last[5:].strip()


async def send_request(client: Any, args: argparse.Namespace, s: Sample) -> RequestResult:
    """One streaming request through `client` (an aiohttp session, its timeout --timeout) to the
    server at --base-url."""
    path, body = _payload(args, s)
    r = RequestResult(prompt_len=s.prompt_len)
    r.sent_at = time.monotonic()
    r.start = time.perf_counter()
    usage_tokens = None
    content_chunks = 0
    try:
        url = args.base_url.rstrip("/") + path
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return r
            async for payload in _sse_data(resp.content):
                now = time.perf_counter() - r.start
                data = json.loads(payload)
                if not r.request_id:
                    r.request_id = data.get("id") or ""
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                    if s.prompt_len <= 0 or args.tokenizer is None:
                        r.prompt_len = data["usage"].get("prompt_tokens") or r.prompt_len
                if _chunk_text(data):
                    r.chunk_times.append(now)
                    content_chunks += 1
        r.e2el = time.perf_counter() - r.start
        r.output_tokens = usage_tokens if usage_tokens is not None else content_chunks
        r.success = bool(r.chunk_times)
        if not r.success:
            r.error = "no content streamed"
    except Exception as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    return finish_result(r)


async def scrape(client: Any, base_url: str) -> dict[str, float] | None:
    import aiohttp

    try:
        async with client.get(base_url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            return server_counters(parse_prometheus(await resp.text()))
    except Exception:
        return None


async def run_once(
    args: argparse.Namespace,
    samples: list[Sample],
    warmups: list[Sample],
    rate: float,
    concurrency: int | None,
) -> dict[str, Any]:
    # aiohttp (its HTTP parser is compiled): the load generator shares the machine with the server,
    # and at 32 streams httpx spent ~140 us of CPU a token against aiohttp's ~55, CPU the server's
    # threads lose (served throughput 373-383 against 396-403 tokens/s on 2 cores).
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # A connection per request, as many as are in flight: a pooled connection the server has closed
    # while idle fails the next request's write (llama.cpp's server does this between requests).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.timeout)  # per request
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as client:
        for w in warmups:
            await send_request(client, args, w)
        before = await scrape(client, args.base_url)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(samples), desc=run_label({"request_rate": None if math.isinf(rate) else rate, "max_concurrency": concurrency}))

        async def one(s: Sample) -> RequestResult:
            if sem is None:
                res = await send_request(client, args, s)
            else:
                async with sem:
                    res = await send_request(client, args, s)
            if bar is not None:
                bar.update(1)
            return res

        tasks = []
        t0 = time.perf_counter()
        gaps = arrival_intervals(rate, args.burstiness, args.seed)
        replay = bool(samples) and all(s.arrival_s is not None for s in samples)
        for i, s in enumerate(samples):
            if replay:  # a trace: its own arrival times
                delay = t0 + (s.arrival_s or 0.0) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            elif i:
                gap = next(gaps)
                if gap > 0:
                    await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(s)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        after = await scrape(client, args.base_url)
    summary = summarize(results, duration, parse_goodput(args.goodput))
    summary.update(
        request_rate=None if math.isinf(rate) else rate,
        burstiness=args.burstiness,
        max_concurrency=concurrency,
        server_metrics=counter_deltas(before, after),
        errors=sorted({r.error for r in results if r.error})[:10],
        ttfts_s=[r.ttft for r in results if r.success],
        itls_s=[x for r in results if r.success for x in r.itl],
        e2els_s=[r.e2el for r in results if r.success],
        output_lens=[r.output_tokens for r in results],
        input_lens=[r.prompt_len for r in results],
    )
    if getattr(args, "request_times", False):
        summary["request_times"] = [
            {"id": r.request_id, "sent_at": r.sent_at, "chunk_times": r.chunk_times, "output_tokens": r.output_tokens}
            for r in results
        ]
    return summary


def format_table(run: dict[str, Any]) -> str:
    rows = [
        ("Successful requests", run["completed"]),
        ("Failed requests", run["failed"]),
        ("Request rate (req/s)", run["request_rate"] if run["request_rate"] is not None else "inf"),
        ("Max concurrency", run["max_concurrency"]),
        ("Benchmark duration (s)", f"{run['duration_s']:.2f}"),
        ("Total input tokens", run["total_input_tokens"]),
        ("Total generated tokens", run["total_output_tokens"]),
        ("Request throughput (req/s)", f"{run['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{run['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{run['total_token_throughput']:.2f}"),
    ]
    if run.get("goodput"):
        rows.append(("Request goodput (req/s)", f"{run['goodput']['request_goodput']:.2f}"))
    for key, title in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2E latency"),
    ):
        s = run[key]
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {title} (ms)", f"{s[stat]:.2f}"))
    for k, v in run.get("server_metrics", {}).items():
        rows.append((f"server {k}", f"{v:.4g}"))
    width = max(len(k) for k, _ in rows) + 2
    lines = [
        "=" * (width + 16),
        " Serving Benchmark Result ".center(width + 16, "="),
        *[f"{k:<{width}}{v!s:>16}" for k, v in rows],
        "=" * (width + 16),
    ]
    return "\n".join(lines)


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model a server's /v1/models lists; ValueError saying why there is none."""
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except Exception as exc:
        raise ValueError(f"no --model given and {url} did not name one: {exc}") from exc


def bench_samples(args: argparse.Namespace) -> tuple[list[Sample], list[Sample]]:
    """The measured requests and the warm-up ones, as the dataset options describe them."""
    tok = load_tokenizer(args.tokenizer)
    samples = build_dataset(args, args.num_prompts, tok)
    warmups = build_dataset(args, args.num_warmups, tok, seed=args.seed + 1) if args.num_warmups > 0 else []
    if args.send_token_ids:
        if any(s.prompt_token_ids is None for s in samples + warmups):
            raise ValueError("--send-token-ids needs prompts with token ids: give --tokenizer")
        samples = [replace(s, send_ids=True) for s in samples]
        warmups = [replace(s, send_ids=True) for s in warmups]
    return samples, warmups


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.model is None:
        args.model = served_model(args.base_url, args.api_key)
        print(f"model: {args.model} (from {args.base_url}/v1/models)", flush=True)
    samples, warmups = bench_samples(args)
    rates = args.request_rate or [math.inf]
    concs: list[int | None] = [int(c) for c in args.max_concurrency] if args.max_concurrency else [None]
    runs = []
    for rate in rates:
        for conc in concs:
            run = asyncio.run(run_once(args, samples, warmups, rate, conc))
            print(format_table(run), flush=True)
            runs.append(run)
    result = {
        "label": args.label or args.model,
        "base_url": args.base_url,
        "model": args.model,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "num_warmups": args.num_warmups,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
    }
    # The first run's summary at the top level, for single-run consumers.
    result.update({k: v for k, v in runs[0].items() if k not in result})
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from tandem.loadgen.plot import plot_results

        plot_results(result, args.plot)
    return result


def main(args: argparse.Namespace) -> int:
    result = run_bench(args)
    return 0 if result["runs"] and all(r["completed"] > 0 for r in result["runs"]) else 1
