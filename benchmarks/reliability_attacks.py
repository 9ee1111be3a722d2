"""The attacks of benchmarks/reliability.py on memory and on the API process's event loop:

- distinct salts: many requests, each with its own `cache_salt` (and a few 8 MB ones): the engine's
  resident memory along the way (a salt's prefix-cache root used to stay forever);
- grammar aborts: streamed requests with distinct schemas whose clients close right after the
  response headers: engine memory and seconds until it is idle (their compiles used to stay);
- enum cache: completed requests with distinct 60k-value enums: engine memory (the compiled-grammar
  cache was bounded by count only);
- stall probe: each nasty input of `nasty_inputs` sent alone while another thread asks `/health`
  every few milliseconds: the input's status and the largest `/health` latency meanwhile (goal:
  at most 100 ms).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

try:  # the openai client ships with httpx2; plain httpx works the same
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from tandem.loadgen.server_process import ServerProcess

MB = 1 << 20
PROMPT = {"prompt": "def fibonacci(n):", "max_tokens": 1, "temperature": 0}


def engine_rss_mb(server: ServerProcess) -> float:
    for line in Path(f"/proc/{server.engine_pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _send_all(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[int]:
    statuses: list[int] = []
    queue = list(reversed(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                try:
                    statuses.append((await http.post("/v1/completions", json=body)).status_code)
                except httpx.HTTPError:
                    statuses.append(0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def distinct_salts(server: ServerProcess, n: int, huge: int) -> dict[str, Any]:
    """`n` requests with a salt each, in ten rounds (engine RSS after each), then `huge` 8 MB salts."""
    rss = [engine_rss_mb(server)]
    statuses: list[int] = []
    rounds = 10
    for r in range(rounds):
        bodies = [{**PROMPT, "cache_salt": f"tenant-{r}-{i}-{random.random()}"} for i in range(n // rounds)]
        statuses += asyncio.run(_send_all(server.url, bodies, 16))
        rss.append(engine_rss_mb(server))
    big = asyncio.run(_send_all(server.url, [{**PROMPT, "cache_salt": "s" * (8 * MB) + str(i)} for i in range(huge)], 2))
    return {
        "requests": n,
        "ok": statuses.count(200),
        "other": len(statuses) - statuses.count(200),
        "engine_rss_mb_by_round": rss,
        "huge_salts": huge,
        "huge_salt_statuses": sorted(set(big)),
        "engine_rss_mb_after_huge": engine_rss_mb(server),
    }


def _enum_schema(i: int, values: int) -> dict[str, Any]:
    """A distinct enum of short strings (60k of them stay under the 1 MiB spec cap)."""
    return {"enum": [f"{i:x}.{j}" for j in range(values)]}


def grammar_aborts(server: ServerProcess, n: int, values: int) -> dict[str, Any]:
    """`n` streamed requests with distinct `values`-value enums, each closed at its headers."""
    before = engine_rss_mb(server)

    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {**PROMPT, "max_tokens": 64, "stream": True, "guided_json": _enum_schema(i, values)}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            return resp.status_code  # leaving the block closes the stream at the headers

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            out = []
            for start in range(0, n, 8):
                out += await asyncio.gather(*(one(http, i) for i in range(start, min(n, start + 8))))
            return out

    start = time.monotonic()
    statuses = asyncio.run(run())
    sent = time.monotonic() - start
    idle_after = _wait_idle(server, 120)
    return {
        "requests": n,
        "enum_values": values,
        "statuses": sorted(set(statuses)),
        "seconds_to_send": sent,
        "seconds_until_idle_after_last": idle_after,
        "engine_rss_mb_before": before,
        "engine_rss_mb_after": engine_rss_mb(server),
    }


def enum_cache(server: ServerProcess, n: int, values: int) -> dict[str, Any]:
    """`n` completed requests with distinct `values`-value enums (a few tokens each)."""
    rss = [engine_rss_mb(server)]
    statuses: list[int] = []
    for i in range(n):
        body = {**PROMPT, "max_tokens": 4, "guided_json": _enum_schema(10**6 + i, values)}
        statuses += asyncio.run(_send_all(server.url, [body], 1))
        if (i + 1) % max(1, n // 8) == 0:
            rss.append(engine_rss_mb(server))
    return {"requests": n, "enum_values": values, "statuses": sorted(set(statuses)), "engine_rss_mb": rss}


def _wait_idle(server: ServerProcess, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        m = server.metrics()
        if m["tandem:num_requests_running"] == 0 and m["tandem:num_requests_waiting"] == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


# -- the stall probe ------------------------------------------------------------------------------


def nasty_inputs(key: str, model: str) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(name, path, body, headers) of each input; bodies encoded up front, so the client spends
    nothing on them while the probe runs."""
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    user = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    def chat(**fields: Any) -> bytes:
        return json.dumps({"model": model, "messages": user, "max_tokens": 4, **fields}).encode()

    def completion(**fields: Any) -> bytes:
        return json.dumps({"model": model, **PROMPT, **fields}).encode()

    big_tool = {"type": "function", "function": {"name": "g", "description": "d" * (5 * MB), "parameters": {}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * (20 * MB)}}
    lark = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(30_000)) + 'r30000: "a"\n'
    rng = random.Random(0)
    regex = "|".join(f"w{rng.randrange(10**9)}" for _ in range(90_000))[: 900_000]
    inputs = [
        ("20 MB tool-call arguments", "/v1/chat/completions",
         json.dumps({"model": model, "max_tokens": 4, "messages": [
             *user, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).encode(), auth),
        ("5 MB tool schema", "/v1/chat/completions", chat(tools=[big_tool]), auth),
        ("10,000 small tools", "/v1/chat/completions",
         chat(tools=[{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(10_000)]), auth),
        ("/tokenize with a 5 MB tool", "/tokenize",
         json.dumps({"model": model, "messages": user, "tools": [big_tool]}).encode(), auth),
        ("30 MB body without a key", "/v1/completions", completion(prompt="x" * (30 * MB)),
         {"Content-Type": "application/json"}),
        ("logit_bias with 1M entries", "/v1/completions",
         completion(logit_bias={str(i): 1 for i in range(1_000_000)}), auth),
        ("0.9 MB regex", "/v1/completions", completion(guided_regex=regex), auth),
        ("bad_words, 64 x 4 KB", "/v1/completions",
         completion(bad_words=["".join(rng.choices("abcdefgh ", k=4096)) for _ in range(64)]), auth),
        ("Lark chain of 30,000 rules", "/v1/completions", completion(guided_grammar=lark), auth),
        ("JSON nested 5,000 deep", "/v1/completions", completion(guided_json="[" * 5000 + "]" * 5000), auth),
        ("60k-value enum (served)", "/v1/completions", completion(guided_json=_enum_schema(7, 60_000)), auth),
    ]
    return inputs


def _probe(url: str, stop: threading.Event, latencies: list[float], interval_s: float) -> None:
    with httpx.Client(base_url=url, timeout=60) as ping:
        while not stop.is_set():
            t0 = time.monotonic()
            ping.get("/health")
            latencies.append(time.monotonic() - t0)
            time.sleep(interval_s)


def stall_probe(server: ServerProcess, key: str, interval_s: float = 0.005) -> list[dict[str, Any]]:
    rows = []
    with httpx.Client(base_url=server.url, timeout=600) as http:
        model = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        for name, path, body, headers in nasty_inputs(key, model):
            latencies: list[float] = []
            stop = threading.Event()
            pinger = threading.Thread(target=_probe, args=(server.url, stop, latencies, interval_s))
            pinger.start()
            time.sleep(0.1)  # the probe's baseline
            t0 = time.monotonic()
            try:
                status = http.post(path, content=body, headers=headers).status_code
            except httpx.HTTPError as exc:
                status = f"client error: {type(exc).__name__}"
            seconds = time.monotonic() - t0
            time.sleep(0.05)
            stop.set()
            pinger.join()
            rows.append({
                "input": name,
                "body_mb": len(body) / MB,
                "status": status,
                "seconds": seconds,
                "health_max_ms": 1000 * max(latencies),
                "health_probes": len(latencies),
            })
    return rows
