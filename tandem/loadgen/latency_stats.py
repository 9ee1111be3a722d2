"""What the client saw of each request, and their statistics: latencies (TTFT, TPOT, ITL, E2E),
percentiles, throughput and goodput under SLOs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds since the request was sent."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival time of every streamed content chunk
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # wall-clock send time (perf_counter), for the timeline
    error: str = ""
    request_id: str = ""  # the server's id for it (its chunks' `id`)
    sent_at: float = 0.0  # time.monotonic() as it was sent: comparable with a server's step trace

    @property
    def tpot(self) -> float:
        return tpot(self.ttft, self.e2el, self.output_tokens)


def itl_from_chunks(chunk_times: Sequence[float]) -> list[float]:
    """Inter-token latencies: the gaps between consecutive streamed chunks (the first chunk is TTFT)."""
    return [b - a for a, b in itertools.pairwise(chunk_times)]


def tpot(ttft: float, e2el: float, output_tokens: int) -> float:
    """Time per output token after the first, as vLLM: (E2E - TTFT) / (tokens - 1); 0 for one token."""
    if output_tokens <= 1:
        return 0.0
    return (e2el - ttft) / (output_tokens - 1)


def finish_result(r: RequestResult) -> RequestResult:
    """Fill TTFT and ITL from the chunk timestamps."""
    if r.chunk_times:
        r.ttft = r.chunk_times[0]
        r.itl = itl_from_chunks(r.chunk_times)
    return r


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """Linear-interpolation percentile (numpy's default); 0 for no values."""
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=float), q))


def stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/median/std/p90/p99 of `values` times `scale` (seconds -> ms by default)."""
    arr = np.asarray(values, dtype=float) * scale
    out = {"mean": float(arr.mean()) if arr.size else 0.0, "std": float(arr.std()) if arr.size else 0.0}
    out["median"] = percentile(arr, 50)
    for q in PERCENTILES[1:]:
        out[f"p{q}"] = percentile(arr, q)
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 0.2, 'tpot': 0.05} (milliseconds in, seconds out)."""
    out: dict[str, float] = {}
    for item in items or []:
        for part in item.split():
            key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad --goodput item {part!r}; want ttft:MS, tpot:MS or e2el:MS")
            ms = float(value)
            if ms <= 0:
                raise ValueError(f"--goodput {key} must be positive")
            out[key] = ms / 1000.0
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(values[k] <= limit for k, limit in slo.items())


def summarize(results: Sequence[RequestResult], duration: float, slo: dict[str, float] | None = None) -> dict:
    """Aggregate metrics of one run (latencies in ms, throughputs per second)."""
    ok = [r for r in results if r.success]
    duration = max(duration, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": stats([x for r in ok for x in r.itl]),
        "e2el_ms": stats([r.e2el for r in ok]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        summary["goodput"] = {
            "slo_ms": {k: v * 1000.0 for k, v in slo.items()},
            "good_requests": good,
            "request_goodput": good / duration,
        }
    else:
        summary["goodput"] = None
    return summary
