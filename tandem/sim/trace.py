"""Request traces for the simulator: when each request arrives, how long its prompt and output are,
and which prompt prefixes it shares with other requests.

Three sources give the same `Trace`: production traces (Azure's LLM inference CSVs, which carry only
lengths, and Mooncake's JSONL, which also carries per-block prefix hashes), synthetic workloads with
controlled rate, burstiness, lengths and prefix sharing, and Tandem's own JSONL (`save_trace`), so that
a workload can be frozen and replayed exactly.

Prefix sharing is expressed as Mooncake does it, by block hashes rather than by tokens: a trace of
100k requests stays small, and `Trace.prompt_token_ids` turns the hashes into real token ids on demand
(equal hashes give equal tokens), so the simulator's real prefix cache finds exactly the sharing the
trace describes.
"""

from __future__ import annotations

import calendar
import csv
import gzip
import itertools
import json
import math
import operator
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

__all__ = [
    "AZURE_SAMPLE",
    "FIRST_TOKEN_ID",
    "MOONCAKE_SAMPLE",
    "SAMPLES_DIR",
    "TANDEM_FORMAT",
    "Trace",
    "TraceRequest",
    "load_azure",
    "load_mooncake",
    "load_tandem",
    "load_trace",
    "save_trace",
    "scale_rate",
    "synthetic",
]

SAMPLES_DIR = Path(__file__).parent / "samples"
AZURE_SAMPLE = SAMPLES_DIR / "azure_conv_sample.csv"
MOONCAKE_SAMPLE = SAMPLES_DIR / "mooncake_sample.jsonl"

# The `format` value of the header line of Tandem's own trace files.
TANDEM_FORMAT = "tandem-trace"
TANDEM_FORMAT_VERSION = 1

# Generated prompts use ids from here up: tokenizers put their special tokens (pad, bos, eos, unk) in
# the lowest ids, and a simulated prompt must never contain an end-of-sequence token.
FIRST_TOKEN_ID = 3

# Mooncake publishes its traces with 512-token hash blocks.
MOONCAKE_BLOCK_TOKENS = 512

_U64_MASK = (1 << 64) - 1
# splitmix64's increment and finalizer constants: a cheap, well-distributed 64-bit mix.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
# Distinct salts keep the token streams of hash blocks and of request-unique parts apart, so a block
# hash equal to some request's index does not give the same tokens.
_HASH_SALT = np.uint64(0x5F3759DF2C6B1E4D)
_INDEX_SALT = np.uint64(0xD1B54A32D192ED03)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> _S30)
    x = x * _MIX1
    x = x ^ (x >> _S27)
    x = x * _MIX2
    return x ^ (x >> _S31)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its arrival, its lengths, and what its prompt shares with others.

    Lengths may be 0 (production traces have a few such rows); what to do with them is the
    simulator's decision, not the trace's. `block_hashes` given as a list is stored as a tuple, and an
    empty one as None, so equal requests compare equal whichever way they were built.
    """

    arrival_s: float  # seconds from the trace's start
    prompt_len: int
    output_len: int
    tenant: str | None = None
    priority: int = 0
    # Prefix sharing: ids of the prompt's consecutive token blocks of `hash_block_tokens` tokens each
    # (Mooncake's hash_ids); requests whose leading ids are equal share that prefix. None: a prompt
    # shared with no one.
    block_hashes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Built by the hundred thousand: plain Python types take the fast path, anything else (numpy
        # scalars, ints as arrival) is checked and converted.
        if not (
            type(self.arrival_s) is float
            and type(self.prompt_len) is int
            and type(self.output_len) is int
            and type(self.priority) is int
        ):
            self._coerce_numbers()
        if not 0.0 <= self.arrival_s < math.inf:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s!r}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.output_len < 0:
            raise ValueError(f"output_len must be >= 0, got {self.output_len}")
        if self.tenant is not None and type(self.tenant) is not str:
            raise ValueError(f"tenant must be a string or None, got {self.tenant!r}")
        if self.block_hashes is not None:
            object.__setattr__(self, "block_hashes", _normalize_hashes(self.block_hashes))

    def _coerce_numbers(self) -> None:
        arrival = self.arrival_s
        if not isinstance(arrival, (int, float, np.integer, np.floating)) or isinstance(arrival, bool):
            raise ValueError(f"arrival_s must be a number, got {arrival!r}")
        object.__setattr__(self, "arrival_s", float(arrival))
        for name in ("prompt_len", "output_len", "priority"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))


def _normalize_hashes(hashes: Sequence[int]) -> tuple[int, ...] | None:
    # The common case checked at C speed: a 100k-request trace holds millions of hashes.
    if type(hashes) is tuple and set(map(type, hashes)) <= {int}:
        return hashes or None
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Sequence):
        raise ValueError(f"block_hashes must be a sequence of ints or None, got {hashes!r}")
    bad = next((h for h in hashes if not _is_int(h)), None)
    if bad is not None:
        raise ValueError(f"block_hashes must hold ints, got {bad!r}")
    return tuple(int(h) for h in hashes) or None


@dataclass(frozen=True, slots=True)
class Trace:
    """A workload: requests sorted by arrival, and the block size their `block_hashes` refer to."""

    requests: list[TraceRequest]  # sorted by arrival_s
    hash_block_tokens: int = 512  # tokens per block_hashes entry (Mooncake uses 512)
    name: str = ""

    def __post_init__(self) -> None:
        if not _is_int(self.hash_block_tokens) or self.hash_block_tokens < 1:
            raise ValueError(f"hash_block_tokens must be an int >= 1, got {self.hash_block_tokens!r}")
        for i, (a, b) in enumerate(itertools.pairwise(self.requests)):
            if b.arrival_s < a.arrival_s:
                raise ValueError(
                    f"requests must be sorted by arrival_s: request {i + 1} arrives at {b.arrival_s} "
                    f"before request {i} at {a.arrival_s}"
                )

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Time from the trace's start to its last arrival."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    def prompt_token_ids(self, index: int, vocab_size: int) -> list[int]:
        """Deterministic prompt token ids, in [FIRST_TOKEN_ID, vocab_size), for request `index`.

        Entry k of `block_hashes` covers tokens [k*B, (k+1)*B) (B = hash_block_tokens) and always
        yields the same B ids, derived from the hash value alone: equal hashes give equal tokens, so
        the real prefix cache sees the sharing the trace describes. A last block cut short by
        prompt_len gets the leading part of its hash's ids; hashes past the prompt's end are ignored.
        The rest of the prompt (all of it when there are no hashes) gets ids derived from the index,
        unique to this request within this trace (two traces replayed together would need their
        indices kept apart). Hash values count modulo 2**64. Computed on demand with vectorised integer mixing (tens of
        microseconds for a few thousand tokens) so a trace of 100k requests never holds its tokens.
        """
        i = operator.index(index)
        if i < 0:
            i += len(self.requests)
        if not 0 <= i < len(self.requests):
            raise IndexError(f"request index {index} out of range for {len(self.requests)} requests")
        if not _is_int(vocab_size) or vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be an int > {FIRST_TOKEN_ID}, got {vocab_size!r}")
        req = self.requests[i]
        n, block = req.prompt_len, self.hash_block_tokens
        hashes = req.block_hashes or ()
        num_blocks = min(len(hashes), -(-n // block))
        covered = min(n, num_blocks * block)

        seeds = np.empty(n, dtype=np.uint64)
        offsets = np.arange(n, dtype=np.uint64)
        if num_blocks:
            keys = np.array([h & _U64_MASK for h in hashes[:num_blocks]], dtype=np.uint64)
            seeds[:covered] = np.repeat(_mix64(keys ^ _HASH_SALT), block)[:covered]
            offsets[:covered] %= np.uint64(block)  # position within the block, not the prompt
        if covered < n:
            seeds[covered:] = _mix64(np.array([i], dtype=np.uint64) ^ _INDEX_SALT)[0]
        tokens = _mix64(seeds + offsets * _GOLDEN)
        span = np.uint64(vocab_size - FIRST_TOKEN_ID)
        return (tokens % span + np.uint64(FIRST_TOKEN_ID)).tolist()


# --- synthetic workloads -------------------------------------------------------------------------

_K = TypeVar("_K")

# Independent random streams per aspect, so that, e.g., adding tenants leaves arrivals and lengths
# of the same seed unchanged.
_STREAMS = ("arrivals", "prompt_len", "output_len", "groups", "tenants", "priorities")


def synthetic(
    num_requests: int,
    rate: float,
    *,
    burstiness: float = 1.0,
    prompt_len: tuple[int, int] = (64, 1024),
    output_len: tuple[int, int] = (16, 256),
    length_dist: str = "lognormal",
    num_prefix_groups: int = 0,
    prefix_len: int = 0,
    tenants: dict[str, float] | None = None,
    priorities: dict[int, float] | None = None,
    hash_block_tokens: int = 16,
    seed: int = 0,
) -> Trace:
    """A synthetic workload, deterministic for a seed.

    Arrivals: the first at 0, then gamma gaps with shape `burstiness` and mean 1/rate (as
    tandem.loadgen.arrivals does for live benchmarks): 1 is a Poisson process, < 1 burstier, > 1
    more regular; rate=inf makes every request arrive at 0.

    Lengths lie in the inclusive (min, max) ranges. "uniform" draws them uniformly. "lognormal"
    (the default) follows what production traces look like, most requests short and a heavy right
    tail: a log-normal whose median is the range's geometric mean and whose +-2 sigma span the range,
    rounded and clipped to it (about 2.3% of draws land on each bound).

    Prefix sharing: with num_prefix_groups > 0, each request joins a uniformly random group and its
    prompt starts with the group's `prefix_len` tokens, expressed as the group's block hashes
    (prefix_len must be a multiple of hash_block_tokens and at most the shortest prompt); the prompt's
    remaining full blocks get hashes no other request has, its last partial block none.

    tenants / priorities: weights (any positive scale) for a random assignment per request.
    """
    if not _is_int(num_requests) or num_requests < 0:
        raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
    if not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate must be > 0 (inf: all at once), got {rate!r}")
    if not isinstance(burstiness, (int, float)) or not math.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"burstiness must be finite and > 0, got {burstiness!r}")
    if length_dist not in ("lognormal", "uniform"):
        raise ValueError(f"length_dist must be 'lognormal' or 'uniform', got {length_dist!r}")
    if not _is_int(hash_block_tokens) or hash_block_tokens < 1:
        raise ValueError(f"hash_block_tokens must be an int >= 1, got {hash_block_tokens!r}")
    _check_range("prompt_len", prompt_len)
    _check_range("output_len", output_len)
    _check_prefix(num_prefix_groups, prefix_len, prompt_len[0], hash_block_tokens)

    rngs = dict(zip(_STREAMS, (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6))))
    n = num_requests
    arrivals = _arrivals(rngs["arrivals"], n, rate, burstiness)
    prompts = _lengths(rngs["prompt_len"], n, prompt_len, length_dist)
    outputs = _lengths(rngs["output_len"], n, output_len, length_dist)
    hashes = _group_hashes(rngs["groups"], prompts, num_prefix_groups, prefix_len, hash_block_tokens)
    tenant_of = (
        _weighted_choice(rngs["tenants"], n, tenants, "tenants") if tenants is not None else [None] * n
    )
    priority_of = (
        _weighted_choice(rngs["priorities"], n, priorities, "priorities")
        if priorities is not None
        else [0] * n
    )
    requests = [
        TraceRequest(arrival, prompt, output, tenant, priority, block_hashes)
        for arrival, prompt, output, tenant, priority, block_hashes in zip(
            arrivals.tolist(), prompts.tolist(), outputs.tolist(), tenant_of, priority_of, hashes
        )
    ]
    name = f"synthetic(n={n}, rate={rate:g}, burstiness={burstiness:g}, seed={seed})"
    return Trace(requests=requests, hash_block_tokens=hash_block_tokens, name=name)


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    if (
        not isinstance(bounds, (tuple, list))
        or len(bounds) != 2
        or not all(_is_int(b) for b in bounds)
        or not 0 <= bounds[0] <= bounds[1]
    ):
        raise ValueError(f"{name} must be (min, max) ints with 0 <= min <= max, got {bounds!r}")


def _check_prefix(groups: int, prefix_len: int, min_prompt: int, block: int) -> None:
    if not _is_int(groups) or groups < 0:
        raise ValueError(f"num_prefix_groups must be an int >= 0, got {groups!r}")
    if not _is_int(prefix_len) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an int >= 0, got {prefix_len!r}")
    if (groups > 0) != (prefix_len > 0):
        raise ValueError(
            f"num_prefix_groups ({groups}) and prefix_len ({prefix_len}) must both be 0 or both > 0"
        )
    if prefix_len % block:
        raise ValueError(f"prefix_len ({prefix_len}) must be a multiple of hash_block_tokens ({block})")
    if prefix_len > min_prompt:
        raise ValueError(f"prefix_len ({prefix_len}) must not exceed the shortest prompt_len ({min_prompt})")


def _arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    if n == 0 or math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _lengths(rng: np.random.Generator, n: int, bounds: tuple[int, int], dist: str) -> np.ndarray:
    lo, hi = bounds
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=n)
    if lo == hi:
        return np.full(n, lo, dtype=np.int64)
    log_lo, log_hi = math.log(max(lo, 1)), math.log(hi)
    draws = rng.lognormal(mean=(log_lo + log_hi) / 2, sigma=(log_hi - log_lo) / 4, size=n)
    return np.clip(np.rint(draws), lo, hi).astype(np.int64)


def _group_hashes(
    rng: np.random.Generator, prompts: np.ndarray, groups: int, prefix_len: int, block: int
) -> list[tuple[int, ...] | None]:
    """Block hashes: ids 0 .. groups*prefix_blocks-1 are the groups' prefixes, later ids are unique."""
    if groups == 0:
        return [None] * len(prompts)
    prefix_blocks = prefix_len // block
    prefixes = [tuple(range(g * prefix_blocks, (g + 1) * prefix_blocks)) for g in range(groups)]
    membership = rng.integers(groups, size=len(prompts))
    next_id = groups * prefix_blocks
    out: list[tuple[int, ...] | None] = []
    for g, length in zip(membership.tolist(), prompts.tolist()):
        own = length // block - prefix_blocks  # >= 0: prefix_len <= the shortest prompt
        out.append(prefixes[g] + tuple(range(next_id, next_id + own)))
        next_id += own
    return out


def _weighted_choice(rng: np.random.Generator, n: int, weights: Mapping[_K, float], what: str) -> list[_K]:
    keys = list(weights)
    w = np.array([weights[k] for k in keys], dtype=float)
    if not keys or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"{what} must map to finite weights >= 0 with a positive sum, got {weights!r}")
    picks = rng.choice(len(keys), size=n, p=w / w.sum())
    return [keys[j] for j in picks.tolist()]


def scale_rate(trace: Trace, factor: float) -> Trace:
    """The same requests at `factor` times the arrival rate (arrivals divided by factor): load levels
    from one trace, keeping its burst structure, lengths and sharing."""
    if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be finite and > 0, got {factor!r}")
    requests = [replace(r, arrival_s=r.arrival_s / factor) for r in trace.requests]
    return Trace(requests=requests, hash_block_tokens=trace.hash_block_tokens, name=trace.name)


# --- files -------------------------------------------------------------------------------------


def _open(path: str | os.PathLike[str], *, write: bool = False) -> IO[str]:
    """A text file, gzip-compressed when its name ends in .gz (how large traces are kept). Reading
    drops a UTF-8 byte-order mark (spreadsheet exports of CSVs add one)."""
    gz = os.fspath(path).endswith(".gz")
    if write:
        return gzip.open(path, "wt", encoding="utf-8") if gz else open(path, "w", encoding="utf-8")
    if gz:
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _trace_name(path: str | os.PathLike[str]) -> str:
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json", ".csv"):
        name = name.removesuffix(suffix)
    return name


def _int_field(value: object, field: str, where: str, *, minimum: int | None = None) -> int:
    """An integer from a CSV cell or JSON value, named by its field in the file; integral floats
    ("12.0") are accepted, as some exports write them."""
    number: object = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"{where}: {field} {value!r} is not an integer") from None
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if not _is_int(number):
        raise ValueError(f"{where}: {field} {value!r} is not an integer")
    result = int(number)  # type: ignore[call-overload]
    if minimum is not None and result < minimum:
        raise ValueError(f"{where}: {field} must be >= {minimum}, got {result}")
    return result


def _request(where: str, **fields: Any) -> TraceRequest:
    """A TraceRequest whose validation errors say which file line they come from."""
    try:
        return TraceRequest(**fields)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _sorted_trace(requests: list[TraceRequest], hash_block_tokens: int, name: str) -> Trace:
    # Stable: requests arriving at the same instant keep their file order.
    requests.sort(key=operator.attrgetter("arrival_s"))
    return Trace(requests=requests, hash_block_tokens=hash_block_tokens, name=name)


# Azure writes "2023-11-16 18:15:46.6805900": .NET's 7 fractional digits (100 ns ticks), which
# datetime.fromisoformat rejects before Python 3.11; other exports use a "T", fewer digits or an offset.
_TIMESTAMP = re.compile(
    r"(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:[.,](\d+))?\s*(Z|[+-]\d{2}:?\d{2})?",
    re.IGNORECASE,
)


def _timestamp_ns(text: str, where: str) -> int:
    """Nanoseconds since the epoch (UTC) of an Azure TIMESTAMP cell; a plain number is taken as seconds."""
    text = text.strip()
    m = _TIMESTAMP.fullmatch(text)
    if m is None:
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{where}: TIMESTAMP {text!r} is not a date-time") from None
        if not math.isfinite(seconds):
            raise ValueError(f"{where}: TIMESTAMP {text!r} is not a date-time")
        return round(seconds * 1e9)
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    try:
        moment = datetime(year, month, day, hour, minute, second, tzinfo=timezone.utc)
    except ValueError as e:
        raise ValueError(f"{where}: TIMESTAMP {text!r}: {e}") from None
    fraction, offset = m.group(7) or "", m.group(8)
    if offset and offset.upper() != "Z":
        sign = 1 if offset[0] == "+" else -1
        digits = offset[1:].replace(":", "")
        moment -= sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    return calendar.timegm(moment.utctimetuple()) * 10**9 + int(fraction[:9].ljust(9, "0"))


_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def load_azure(path: str | os.PathLike[str]) -> Trace:
    """An Azure LLM inference trace (2023/2024 CSV: TIMESTAMP, ContextTokens, GeneratedTokens).

    Arrivals are relative to the earliest row (the first, in Azure's time-sorted files). The trace
    has no prefix information: every prompt is shared with no one.
    """
    rows: list[tuple[int, int, int]] = []
    with _open(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected a header {','.join(_AZURE_COLUMNS)}")
        names = {name.strip().lower(): k for k, name in enumerate(header)}
        missing = [c for c in _AZURE_COLUMNS if c.lower() not in names]
        if missing:
            raise ValueError(f"{path}, line 1: missing column(s) {', '.join(missing)} in header {header}")
        cols = [names[c.lower()] for c in _AZURE_COLUMNS]
        for row in reader:
            if all(not cell.strip() for cell in row):
                continue
            where = f"{path}, line {reader.line_num}"
            if len(row) <= max(cols):
                raise ValueError(f"{where}: expected {len(header)} columns, got {len(row)}: {row}")
            rows.append(
                (
                    _timestamp_ns(row[cols[0]], where),
                    _int_field(row[cols[1]], "ContextTokens", where, minimum=0),
                    _int_field(row[cols[2]], "GeneratedTokens", where, minimum=0),
                )
            )
    start = min((ns for ns, _, _ in rows), default=0)
    requests = [TraceRequest((ns - start) / 1e9, prompt, output) for ns, prompt, output in rows]
    return _sorted_trace(requests, MOONCAKE_BLOCK_TOKENS, _trace_name(path))


def _json_lines(f: IO[str], path: str | os.PathLike[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, object) per non-blank line of a JSONL file."""
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def _required(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ValueError(f"{where}: missing key {key!r}")
    return obj[key]


def _hash_list(value: object, field: str, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"{where}: {field} must be a list of ints, got {value!r}")
    return tuple(_int_field(h, field, where) for h in value) or None


def load_mooncake(path: str | os.PathLike[str]) -> Trace:
    """A Mooncake trace: JSONL of {"timestamp": ms, "input_length", "output_length", "hash_ids"},
    hash_ids being the prompt's 512-token blocks. Arrivals are relative to the earliest timestamp."""
    rows: list[tuple[float, int, int, tuple[int, ...] | None]] = []
    with _open(path) as f:
        for where, obj in _json_lines(f, path):
            ms = _required(obj, "timestamp", where)
            if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not math.isfinite(ms):
                raise ValueError(f"{where}: timestamp {ms!r} is not a number of milliseconds")
            rows.append(
                (
                    float(ms),
                    _int_field(_required(obj, "input_length", where), "input_length", where, minimum=0),
                    _int_field(_required(obj, "output_length", where), "output_length", where, minimum=0),
                    _hash_list(_required(obj, "hash_ids", where), "hash_ids", where),
                )
            )
    start = min((ms for ms, _, _, _ in rows), default=0.0)
    requests = [
        TraceRequest((ms - start) / 1000.0, prompt, output, block_hashes=hashes)
        for ms, prompt, output, hashes in rows
    ]
    return _sorted_trace(requests, MOONCAKE_BLOCK_TOKENS, _trace_name(path))


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Tandem's own JSONL: a header line {"format": "tandem-trace", "version", "hash_block_tokens",
    "name"}, then one request per line, fields at their defaults left out. Loads back equal."""
    header = {
        "format": TANDEM_FORMAT,
        "version": TANDEM_FORMAT_VERSION,
        "hash_block_tokens": trace.hash_block_tokens,
        "name": trace.name,
    }
    with _open(path, write=True) as f:
        f.write(json.dumps(header) + "\n")
        for r in trace.requests:
            f.write(json.dumps(_request_json(r), allow_nan=False, separators=(",", ":")) + "\n")


def _request_json(r: TraceRequest) -> dict[str, Any]:
    obj: dict[str, Any] = {"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len}
    if r.tenant is not None:
        obj["tenant"] = r.tenant
    if r.priority:
        obj["priority"] = r.priority
    if r.block_hashes is not None:
        obj["block_hashes"] = list(r.block_hashes)
    return obj


def load_tandem(path: str | os.PathLike[str]) -> Trace:
    """A trace written by save_trace. Unknown keys are ignored (files from later versions that add
    fields still load)."""
    with _open(path) as f:
        lines = _json_lines(f, path)
        first = next(lines, None)
        if first is None:
            raise ValueError(f"{path}: empty file, expected a {TANDEM_FORMAT!r} header line")
        where, header = first
        if header.get("format") != TANDEM_FORMAT:
            raise ValueError(
                f"{where}: header's format must be {TANDEM_FORMAT!r}, got {header.get('format')!r}"
            )
        version = header.get("version", TANDEM_FORMAT_VERSION)
        if version != TANDEM_FORMAT_VERSION:
            raise ValueError(
                f"{where}: unsupported version {version!r} (this Tandem reads {TANDEM_FORMAT_VERSION})"
            )
        block = _int_field(
            _required(header, "hash_block_tokens", where), "hash_block_tokens", where, minimum=1
        )
        name = header.get("name", "")
        if not isinstance(name, str):
            raise ValueError(f"{where}: name must be a string, got {name!r}")
        requests = [_tandem_request(obj, where) for where, obj in lines]
    try:
        return Trace(requests=requests, hash_block_tokens=block, name=name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _tandem_request(obj: dict[str, Any], where: str) -> TraceRequest:
    arrival = _required(obj, "arrival_s", where)
    return _request(
        where,
        arrival_s=arrival,
        prompt_len=_int_field(_required(obj, "prompt_len", where), "prompt_len", where, minimum=0),
        output_len=_int_field(_required(obj, "output_len", where), "output_len", where, minimum=0),
        tenant=obj.get("tenant"),
        priority=_int_field(obj.get("priority", 0), "priority", where),
        block_hashes=_hash_list(obj.get("block_hashes"), "block_hashes", where),
    )


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Any supported trace, recognised by its first line (whatever the file's extension, .gz or not):
    a Tandem header, a Mooncake request object, or a CSV header naming Azure's columns."""
    with _open(path) as f:
        first = next((line.strip() for line in f if line.strip()), None)
    if first is None:
        raise ValueError(f"{path}: empty file, not a trace")
    if first.startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, first line: invalid JSON: {e.msg}") from None
        if isinstance(obj, dict) and obj.get("format") == TANDEM_FORMAT:
            return load_tandem(path)
        if isinstance(obj, dict) and {"input_length", "hash_ids"} & obj.keys():
            return load_mooncake(path)
        raise ValueError(f"{path}: a JSON line that is neither a Tandem trace header nor a Mooncake request")
    columns = {c.strip().lower() for c in next(csv.reader([first]))}
    if {c.lower() for c in _AZURE_COLUMNS} <= columns:
        return load_azure(path)
    raise ValueError(f"{path}: unrecognised trace format (first line {first[:80]!r})")
