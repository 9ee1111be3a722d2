"""Reliability under abuse: what one client's burst, disconnects, idle sockets or a dead engine cost.

Runs `tandem serve` (the embedded default model unless `--model`) and measures, in one run:

- overload burst: N concurrent requests far past `--max-waiting-requests`: how many complete, how
  many get 503 with Retry-After, whether any fail otherwise, and resident memory before and after;
- disconnect storm: many streaming requests dropped at once: seconds until the engine runs none and
  every KV block is free again;
- slowloris: many idle connections from one address (127.0.0.2) held for longer than the header
  timeout: /health and completion latency and success for another client meanwhile, and seconds
  until the server has closed the idle ones;
- fuzz: a seeded schemathesis run over every endpoint: cases sent, server errors (5xx);
- engine kill: SIGKILL of the engine process with streams in flight: seconds until /health says so
  and until every client has its error, and the server's exit code;
- memory and the event loop (benchmarks/reliability_attacks.py): 10,000 distinct cache salts,
  1,000 distinct grammars aborted at their headers, 160 distinct 60k-value enums, and the stall
  probe: the largest /health latency while each nasty input (20 MB tool arguments, a 30 MB
  unauthenticated body, a 30,000-rule grammar, ...) is in flight.

    python benchmarks/reliability.py                 # default model, full sizes
    python benchmarks/reliability.py --quick         # smaller sizes
    python benchmarks/reliability.py --sections stall,salts --quick   # some of it (CI runs this)
    python benchmarks/reliability.py --result-json out.json

Prints one table and writes every figure as JSON. Only loopback traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

try:  # the openai client ships with httpx2; plain httpx works the same
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from reliability_attacks import distinct_salts, enum_cache, grammar_aborts, stall_probe

from tandem.cpu import cpu_flags, cpu_model
from tandem.entrypoints.llm import default_model_path
from tandem.loadgen.fuzz import fuzz_openapi
from tandem.loadgen.server_process import ServerProcess

SECTIONS = ("burst", "storm", "slowloris", "fuzz", "kill", "salts", "aborts", "enums", "stall")

# Long requests (storm, kill) ask for 1500 tokens: within the default model's 2048-token context.
COMPLETION = {"prompt": "def fibonacci(n):", "max_tokens": 16, "ignore_eos": True, "temperature": 0}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_until(cond, timeout: float, interval: float = 0.01) -> float | None:
    """Seconds until `cond()` holds, or None if it did not within `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(interval)
    return None


def idle(server: ServerProcess) -> bool:
    m = server.metrics()
    return m["tandem:num_requests_running"] == 0 and m["tandem:kv_cache_usage_perc"] == 0.0


# -- overload burst ---------------------------------------------------------------------------


async def _burst(url: str, n: int) -> list[tuple[int, str | None, float]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:

        async def one() -> tuple[int, str | None, float]:
            start = time.monotonic()
            try:
                r = await http.post("/v1/completions", json=COMPLETION)
                return r.status_code, r.headers.get("retry-after"), time.monotonic() - start
            except httpx.HTTPError:
                return -1, None, time.monotonic() - start

        return await asyncio.gather(*(one() for _ in range(n)))


def overload_burst(server: ServerProcess, n: int) -> dict[str, Any]:
    rss_before = server.rss_kb()
    start = time.monotonic()
    results = asyncio.run(_burst(server.url, n))
    seconds = time.monotonic() - start
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 503]
    return {
        "requests": n,
        "completed": len(ok),
        "rejected_503": len(rejected),
        "rejected_with_retry_after": sum(1 for r in rejected if r[1] is not None),
        "other": len(results) - len(ok) - len(rejected),
        "seconds": seconds,
        "completed_p99_s": percentile([r[2] for r in ok], 0.99),
        "rss_before_mb": rss_before / 1024,
        "rss_after_mb": server.rss_kb() / 1024,
        "left_idle": wait_until(lambda: idle(server), 30) is not None,
    }


# -- disconnect storm -------------------------------------------------------------------------


def disconnect_storm(server: ServerProcess, n: int) -> dict[str, Any]:
    body = json.dumps({**COMPLETION, "max_tokens": 1500, "stream": True}).encode()
    sockets = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        sockets.append(sock)
    started = wait_until(lambda: server.metrics()["tandem:num_requests_running"] > 0, 30)
    time.sleep(0.5)
    running = server.metrics()["tandem:num_requests_running"]
    start = time.monotonic()
    for sock in sockets:
        sock.close()
    freed = wait_until(lambda: idle(server), 30)
    return {
        "streams": n,
        "running_when_dropped": running,
        "started": started is not None,
        "seconds_until_kv_free": freed if freed is None else time.monotonic() - start,
    }


# -- slowloris ----------------------------------------------------------------------------------


def slowloris(server: ServerProcess, n: int, header_timeout: float) -> dict[str, Any]:
    attackers = []
    refused_at_connect = 0
    for _ in range(n):
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        try:
            sock.connect(("127.0.0.1", server.port))
        except OSError:
            refused_at_connect += 1
            sock.close()
            continue
        attackers.append(sock)
    health, completions, failures = [], [], 0
    hold_until = time.monotonic() + header_timeout + 2
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while time.monotonic() < hold_until:
            for path, sink in (("/health", health), ("/v1/completions", completions)):
                start = time.monotonic()
                try:
                    r = http.get(path) if path == "/health" else http.post(path, json=COMPLETION)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                sink.append(time.monotonic() - start)
                failures += not ok
            time.sleep(0.1)
    start = time.monotonic()
    closed = 0
    for sock in attackers:
        sock.settimeout(max(0.1, header_timeout + 10 - (time.monotonic() - start)))
        try:
            while sock.recv(65536):
                pass
            closed += 1  # end of stream: the server closed it
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
        sock.close()
    return {
        "idle_connections": n,
        "refused_at_connect": refused_at_connect,
        "other_client_requests": len(health) + len(completions),
        "other_client_failures": failures,
        "health_p99_s": percentile(health, 0.99),
        "completion_p99_s": percentile(completions, 0.99),
        "closed_by_server": closed,
        "seconds_to_close_all_after_hold": time.monotonic() - start,
    }


# -- fuzz ---------------------------------------------------------------------------------------


def fuzz(server: ServerProcess, examples: int) -> dict[str, Any]:
    counts = {"5xx": 0, "4xx_without_openai_body": 0}

    def check(label: str, resp: Any) -> None:
        counts["5xx"] += resp.status_code >= 500
        if 400 <= resp.status_code < 500:
            try:
                ok = set(resp.json()["error"]) == {"message", "type", "param", "code"}
            except (ValueError, KeyError, TypeError):
                ok = False
            counts["4xx_without_openai_body"] += not ok

    start = time.monotonic()
    counts["cases"] = fuzz_openapi(server.url, examples, check)
    counts["seconds"] = time.monotonic() - start
    counts["left_idle"] = wait_until(lambda: idle(server), 30) is not None
    return counts


# -- engine kill --------------------------------------------------------------------------------


def engine_kill(server: ServerProcess, n: int) -> dict[str, Any]:
    errors: list[float] = []
    marks: dict[str, float] = {}

    async def stream(http: httpx.AsyncClient) -> None:
        body = {**COMPLETION, "max_tokens": 1500, "stream": True}
        try:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        break
        except httpx.HTTPError:
            pass
        errors.append(time.monotonic() - marks["kill"])

    async def watch_health(http: httpx.AsyncClient) -> None:
        while True:
            try:
                healthy = (await http.get("/health", timeout=2)).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if not healthy:
                marks["unhealthy"] = time.monotonic() - marks["kill"]
                return
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            tasks = [asyncio.create_task(stream(http)) for _ in range(n)]
            deadline = time.monotonic() + 60
            while server.metrics()["tandem:num_requests_running"] < min(n, 4):
                if time.monotonic() > deadline:
                    raise RuntimeError("the streams never started")
                await asyncio.sleep(0.02)
            marks["kill"] = time.monotonic()
            os.kill(server.engine_pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(watch_health(http), *tasks), 60)

    asyncio.run(scenario())
    try:
        code = server.proc.wait(30)
    except Exception:
        code = None
    return {
        "streams": n,
        "clients_with_error": len(errors),
        "seconds_to_last_client_error": max(errors) if errors else None,
        "seconds_to_unhealthy": marks.get("unhealthy"),
        "server_exit_code": code,
    }


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--quick", action="store_true", help="smaller sizes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--result-json", default=None)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        p.error(f"unknown sections {sorted(sections - set(SECTIONS))}")
    model = args.model or default_model_path()
    sizes = (
        {"burst": 120, "storm": 16, "idle": 200, "fuzz": 10, "kill": 4, "salts": 1000, "huge_salts": 4,
         "aborts": 100, "abort_enum": 2000, "enums": 16, "enum_values": 60_000}
        if args.quick
        else {"burst": 600, "storm": 64, "idle": 1600, "fuzz": 25, "kill": 16, "salts": 10_000,
              "huge_salts": 40, "aborts": 1000, "abort_enum": 2000, "enums": 160, "enum_values": 60_000}
    )
    header_timeout = 2.0
    server_args = ["--num-threads", str(args.threads), "--max-num-seqs", "16", "--max-waiting-requests", "64"]
    server_args += ["--num-kv-blocks", "2048", "--header-timeout", str(header_timeout)]
    results: dict[str, Any] = {
        "command_line": shlex.join([sys.executable, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "amx": "amx_bf16" in cpu_flags()},
        "model": "default" if args.model is None else Path(model).name,
        "quick": args.quick,
        "sizes": sizes,
        "server_args": server_args,
    }
    if sections & {"burst", "storm", "slowloris", "fuzz"}:
        with ServerProcess(model, *server_args) as server:
            if "burst" in sections:
                results["overload_burst"] = overload_burst(server, sizes["burst"])
            if "storm" in sections:
                results["disconnect_storm"] = disconnect_storm(server, sizes["storm"])
            if "slowloris" in sections:
                results["slowloris"] = slowloris(server, sizes["idle"], header_timeout)
            if "fuzz" in sections:
                results["fuzz"] = fuzz(server, sizes["fuzz"])
    if "kill" in sections:
        with ServerProcess(model, *server_args) as server:
            results["engine_kill"] = engine_kill(server, sizes["kill"])
    if sections & {"salts", "aborts", "enums"}:
        with ServerProcess(model, *server_args) as server:
            if "salts" in sections:
                results["distinct_salts"] = distinct_salts(server, sizes["salts"], sizes["huge_salts"])
            if "aborts" in sections:
                results["grammar_aborts"] = grammar_aborts(server, sizes["aborts"], sizes["abort_enum"])
            if "enums" in sections:
                results["enum_cache"] = enum_cache(server, sizes["enums"], sizes["enum_values"])
    if "stall" in sections:
        key = "reliability-key"
        with ServerProcess(model, *server_args, "--api-key", key) as server:
            results["stall_probe"] = stall_probe(server, key)
    print_table(results)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(r: dict[str, Any]) -> None:
    def secs(x: float | None) -> str:
        return "never" if x is None else f"{x:.2f} s"

    rows: list[tuple[str, str]] = []
    if "overload_burst" in r:
        b = r["overload_burst"]
        rows.append((
            f"overload burst ({b['requests']} at once)",
            f"{b['completed']} completed, {b['rejected_503']} 503 ({b['rejected_with_retry_after']} with "
            f"Retry-After), {b['other']} other; RSS {b['rss_before_mb']:.0f} -> {b['rss_after_mb']:.0f} MB; "
            f"p99 of completed {secs(b['completed_p99_s'])}",
        ))
    if "disconnect_storm" in r:
        d = r["disconnect_storm"]
        rows.append((
            f"disconnect storm ({d['streams']} streams)",
            f"{d['running_when_dropped']:.0f} running when dropped; KV free after {secs(d['seconds_until_kv_free'])}",
        ))
    if "slowloris" in r:
        s = r["slowloris"]
        rows.append((
            f"slowloris ({s['idle_connections']} idle sockets)",
            f"other client: {s['other_client_failures']} failed of {s['other_client_requests']}, health p99 "
            f"{secs(s['health_p99_s'])}, completion p99 {secs(s['completion_p99_s'])}; "
            f"{s['closed_by_server']} closed by the server",
        ))
    if "fuzz" in r:
        f = r["fuzz"]
        rows.append((
            "fuzz (schemathesis, every endpoint)",
            f"{f['cases']} cases, {f['5xx']} 5xx, {f['4xx_without_openai_body']} 4xx without OpenAI body, "
            f"{secs(f['seconds'])}",
        ))
    if "engine_kill" in r:
        k = r["engine_kill"]
        rows.append((
            f"engine kill ({k['streams']} streams)",
            f"{k['clients_with_error']} clients got an error, the last after "
            f"{secs(k['seconds_to_last_client_error'])}; /health not 200 after "
            f"{secs(k['seconds_to_unhealthy'])}; exit code {k['server_exit_code']}",
        ))
    if "distinct_salts" in r:
        ds = r["distinct_salts"]
        rss = ds["engine_rss_mb_by_round"]
        rows.append((
            f"distinct salts ({ds['requests']}, then {ds['huge_salts']} of 8 MB)",
            f"{ds['ok']} ok, {ds['other']} other; engine RSS {rss[0]:.0f} -> {rss[1]:.0f} (first tenth) -> "
            f"{rss[-1]:.0f} MB; 8 MB salts got {ds['huge_salt_statuses']}, RSS then {ds['engine_rss_mb_after_huge']:.0f} MB",
        ))
    if "grammar_aborts" in r:
        ga = r["grammar_aborts"]
        rows.append((
            f"grammar aborts ({ga['requests']} distinct {ga['enum_values']}-value enums)",
            f"statuses {ga['statuses']}; idle {secs(ga['seconds_until_idle_after_last'])} after the last; "
            f"engine RSS {ga['engine_rss_mb_before']:.0f} -> {ga['engine_rss_mb_after']:.0f} MB",
        ))
    if "enum_cache" in r:
        ec = r["enum_cache"]
        rows.append((
            f"enum cache ({ec['requests']} distinct {ec['enum_values']}-value enums, served)",
            f"statuses {ec['statuses']}; engine RSS " + " -> ".join(f"{x:.0f}" for x in ec["engine_rss_mb"]) + " MB",
        ))
    for row in r.get("stall_probe", []):
        rows.append((
            f"stall probe: {row['input']}",
            f"{row['status']} in {row['seconds']:.2f} s; /health max {row['health_max_ms']:.0f} ms "
            f"over {row['health_probes']} probes",
        ))
    width = max(len(a) for a, _ in rows)
    print()
    for a, text in rows:
        print(f"{a:<{width}}  {text}")
    print()
    print("ran:", r["command_line"])


if __name__ == "__main__":
    raise SystemExit(main())
