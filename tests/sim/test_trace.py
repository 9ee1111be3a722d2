"""Simulator traces: the Azure and Mooncake loaders, Tandem's own format, synthetic workloads, and
the prompt token ids that let the real prefix cache see a trace's sharing."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tandem.sim.trace import (
    AZURE_SAMPLE,
    FIRST_TOKEN_ID,
    MOONCAKE_SAMPLE,
    Trace,
    TraceRequest,
    load_azure,
    load_mooncake,
    load_tandem,
    load_trace,
    save_trace,
    scale_rate,
    synthetic,
)

VOCAB = 32000


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def blocks_of(ids: list[int], size: int = 16) -> set[tuple[int, ...]]:
    return {tuple(ids[k : k + size]) for k in range(0, len(ids) - size + 1, size)}


# --- sample files and loaders ----------------------------------------------------------------------


def test_azure_sample_loads_sorted_from_zero() -> None:
    trace = load_azure(AZURE_SAMPLE)
    assert len(trace) == 300 and trace.name == "azure_conv_sample"
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    # The sample's second row is 18:15:46.8548563 after the first's 18:15:46.6805900.
    assert arrivals[1] == pytest.approx(0.1742663, abs=1e-9)
    assert all(r.block_hashes is None and r.prompt_len > 0 and r.output_len > 0 for r in trace.requests)
    assert 500 < np.median([r.prompt_len for r in trace.requests]) < 2000


def test_azure_timestamps_with_seven_fractional_digits_and_other_spellings(tmp_path: Path) -> None:
    csv = write(
        tmp_path / "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,10,1\n"
        "2023-11-16 18:15:47.0000001,20,2\n"
        "2023-11-16 23:59:59.9999999,30,3\n"
        "2023-11-17T00:00:01Z,40,4\n"
        "2023-11-17 00:00:02.5+00:00,50,5\n"
        "2023-11-17 01:00:03.25+01:00,60,6\n",
    )
    arrivals = [r.arrival_s for r in load_azure(csv).requests]
    day_end = (23 - 18) * 3600 + (59 - 15) * 60 + (59.9999999 - 46.6805900)
    expected = [0.0, 0.3194101, day_end, day_end + 1.0000001, day_end + 2.5000001, day_end + 3.2500001]
    assert arrivals == pytest.approx(expected, abs=1e-9)


def test_azure_unsorted_rows_are_relative_to_the_earliest(tmp_path: Path) -> None:
    csv = write(
        tmp_path / "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:05.0000000,5,1\n2024-05-10 00:00:01.0000000,1,1\n",
    )
    trace = load_azure(csv)
    assert [(r.arrival_s, r.prompt_len) for r in trace.requests] == [(0.0, 1), (4.0, 5)]


def test_mooncake_sample_loads_with_prefix_sharing() -> None:
    trace = load_mooncake(MOONCAKE_SAMPLE)
    assert len(trace) == 300 and trace.hash_block_tokens == 512
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    for r in trace.requests:
        assert r.block_hashes is not None and len(r.block_hashes) == -(-r.prompt_len // 512)
    first_blocks = Counter(r.block_hashes[0] for r in trace.requests if r.block_hashes)
    assert sum(n for n in first_blocks.values() if n > 1) > 100  # many requests share a leading block


def test_mooncake_timestamps_are_milliseconds_from_the_first(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 3500, "input_length": 10, "output_length": 1, "hash_ids": []},
    ]
    path = write(tmp_path / "m.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    trace = load_mooncake(path)
    assert trace.requests == [
        TraceRequest(0.0, 600, 3, block_hashes=(7, 8)),
        TraceRequest(2.5, 10, 1, block_hashes=None),
    ]


def test_load_trace_recognises_each_format(tmp_path: Path) -> None:
    assert load_trace(AZURE_SAMPLE) == load_azure(AZURE_SAMPLE)
    assert load_trace(MOONCAKE_SAMPLE) == load_mooncake(MOONCAKE_SAMPLE)
    ours = synthetic(20, 5.0, seed=1)
    save_trace(ours, tmp_path / "ours.txt")  # the extension does not matter
    assert load_trace(tmp_path / "ours.txt") == ours
    with pytest.raises(ValueError, match="unrecognised"):
        load_trace(write(tmp_path / "x.csv", "a,b,c\n1,2,3\n"))
    with pytest.raises(ValueError, match="empty"):
        load_trace(write(tmp_path / "e.jsonl", "\n"))


# --- Tandem's own format ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_save_load_round_trip(tmp_path: Path, suffix: str) -> None:
    trace = synthetic(
        200,
        3.0,
        num_prefix_groups=3,
        prefix_len=64,
        tenants={"a": 1.0, "b": 1.0},
        priorities={0: 1.0, -2: 1.0},
        seed=4,
    )
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    assert load_trace(path) == trace
    with_extremes = Trace([TraceRequest(0.1 + 0.2, 0, 0, tenant="ü", block_hashes=(-1, 2**70))], 7, "x")
    save_trace(with_extremes, path)
    assert load_tandem(path) == with_extremes
    save_trace(Trace([], name="empty"), path)
    assert load_trace(path) == Trace([], name="empty")


def test_tandem_header_is_the_first_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(Trace([TraceRequest(1.5, 3, 4)], hash_block_tokens=16, name="n"), path)
    header, request = (json.loads(line) for line in path.read_text().splitlines())
    assert header == {"format": "tandem-trace", "version": 1, "hash_block_tokens": 16, "name": "n"}
    assert request == {"arrival_s": 1.5, "prompt_len": 3, "output_len": 4}


# --- bad input -------------------------------------------------------------------------------------

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD_ROW = "2023-11-16 18:15:46.6805900,10,1\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.0000000,ten,1\n", r"line 3: ContextTokens 'ten'"),
        (AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.0000000,10\n", r"line 3: expected 3 columns"),
        (AZURE_HEADER + "yesterday,10,1\n", r"line 2: TIMESTAMP 'yesterday'"),
        (AZURE_HEADER + "2023-13-16 18:15:46.1,10,1\n", r"line 2: TIMESTAMP"),
        (AZURE_HEADER + "2023-11-16 18:15:46.1,10,-4\n", r"line 2: GeneratedTokens must be >= 0"),
        ("TIMESTAMP,ContextTokens\n" + GOOD_ROW, r"line 1: missing column\(s\) GeneratedTokens"),
    ],
)
def test_bad_azure_rows_name_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_azure(write(tmp_path / "bad.csv", text))


MOONCAKE_OK = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 5, "input_length": 5, "hash_ids": [1]}', r"line 2: missing key 'output_length'"),
        ('{"timestamp": 5, "input_length": 5, "output_length": 1}', r"line 2: missing key 'hash_ids'"),
        (
            '{"timestamp": 5, "input_length": -5, "output_length": 1, "hash_ids": []}',
            r"line 2: input_length must be >= 0",
        ),
        (
            '{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": []}',
            r"line 2: timestamp 'x'",
        ),
        (
            '{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}',
            r"line 2: hash_ids 'a'",
        ),
        ('{"timestamp": 5, "input_length": 5', r"line 2: invalid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object"),
    ],
)
def test_bad_mooncake_lines_name_line_and_key(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_mooncake(write(tmp_path / "bad.jsonl", MOONCAKE_OK + line + "\n"))


def test_bad_tandem_files_name_line_and_key(tmp_path: Path) -> None:
    header = '{"format": "tandem-trace", "hash_block_tokens": 16}\n'
    cases = [
        (header + '{"arrival_s": 0, "output_len": 1}\n', r"line 2: missing key 'prompt_len'"),
        (
            header + '{"arrival_s": 0, "prompt_len": -1, "output_len": 1}\n',
            r"line 2: prompt_len must be >= 0",
        ),
        (header + '{"arrival_s": -1, "prompt_len": 1, "output_len": 1}\n', r"line 2: arrival_s must be"),
        (header + '{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "tenant": 5}\n', r"line 2: tenant"),
        (
            header
            + '{"arrival_s": 2, "prompt_len": 1, "output_len": 1}\n{"arrival_s": 1, "prompt_len": 1, "output_len": 1}\n',
            r"sorted by arrival_s",
        ),
        ('{"format": "tandem-trace"}\n', r"line 1: missing key 'hash_block_tokens'"),
        ('{"format": "tandem-trace", "hash_block_tokens": 0}\n', r"hash_block_tokens must be >= 1"),
        ('{"format": "tandem-trace", "version": 9, "hash_block_tokens": 16}\n', r"unsupported version 9"),
    ]
    for text, message in cases:
        with pytest.raises(ValueError, match=message):
            load_tandem(write(tmp_path / "bad.jsonl", text))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_len": -1}, "prompt_len"),
        ({"output_len": -3}, "output_len"),
        ({"arrival_s": float("nan")}, "arrival_s"),
        ({"priority": 1.5}, "priority"),
        ({"block_hashes": [1, "2"]}, "block_hashes"),
    ],
)
def test_request_validation_names_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TraceRequest(**{"arrival_s": 0.0, "prompt_len": 1, "output_len": 1, **fields})


def test_requests_normalise_numpy_and_list_input() -> None:
    r = TraceRequest(np.float32(2.0), np.int64(3), 4, block_hashes=[np.int64(5), 6])  # type: ignore[arg-type]
    assert r == TraceRequest(2.0, 3, 4, block_hashes=(5, 6))
    assert type(r.prompt_len) is int and TraceRequest(0.0, 1, 1, block_hashes=[]).block_hashes is None  # type: ignore[arg-type]


def test_trace_must_be_sorted() -> None:
    with pytest.raises(ValueError, match="request 1 arrives"):
        Trace([TraceRequest(1.0, 1, 1), TraceRequest(0.5, 1, 1)])
    with pytest.raises(ValueError, match="hash_block_tokens"):
        Trace([], hash_block_tokens=0)


# --- prompt token ids ------------------------------------------------------------------------------


def test_prompt_token_ids_length_range_and_determinism() -> None:
    trace = synthetic(50, 1.0, prompt_len=(1, 3000), num_prefix_groups=0, seed=2)
    again = synthetic(50, 1.0, prompt_len=(1, 3000), num_prefix_groups=0, seed=2)
    for i, r in enumerate(trace.requests):
        ids = trace.prompt_token_ids(i, 100)
        assert len(ids) == r.prompt_len
        assert min(ids) >= FIRST_TOKEN_ID and max(ids) < 100 and all(type(t) is int for t in ids)
        assert ids == again.prompt_token_ids(i, 100)
    assert trace.prompt_token_ids(-1, VOCAB) == trace.prompt_token_ids(len(trace) - 1, VOCAB)
    with pytest.raises(IndexError):
        trace.prompt_token_ids(len(trace), VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        trace.prompt_token_ids(0, FIRST_TOKEN_ID)


def test_equal_hashes_give_equal_tokens_whatever_else_differs() -> None:
    block = 16
    trace = Trace(
        [
            TraceRequest(0.0, 100, 1, block_hashes=(1, 2, 3, 4, 5, 6, 7)),
            TraceRequest(0.0, 40, 1, block_hashes=(1, 2, 9)),  # shares 2 blocks, then a partial own one
            TraceRequest(0.0, 24, 1, block_hashes=(1, 2, 3, 4)),  # cut inside block 2; extra hashes ignored
            TraceRequest(0.0, 50, 1, block_hashes=(9,)),  # hash 9 at another position: same 16 ids
            TraceRequest(0.0, 100, 1),
        ],
        hash_block_tokens=block,
    )
    a, b, c, d, e = (trace.prompt_token_ids(i, VOCAB) for i in range(5))
    assert b[:32] == a[:32] and b[32:40] != a[32:40]
    assert c == a[:24]
    assert d[:8] == b[32:40]
    # Past the hashed blocks, and without hashes, every request has tokens of its own.
    assert not blocks_of(a[block * 7 :]) & blocks_of(e)
    assert not blocks_of(d[16:]) & (blocks_of(a) | blocks_of(e))


def test_requests_without_hashes_share_no_block() -> None:
    trace = Trace([TraceRequest(0.0, 512, 1) for _ in range(200)], hash_block_tokens=16)
    seen: set[tuple[int, ...]] = set()
    for i in range(len(trace)):
        own = blocks_of(trace.prompt_token_ids(i, VOCAB))
        assert not own & seen
        seen |= own


def test_prompt_token_ids_are_fast() -> None:
    hashed = Trace(
        [TraceRequest(0.0, 1024, 1, block_hashes=tuple(range(k, k + 64))) for k in range(1000)], 16
    )
    plain = Trace([TraceRequest(0.0, 1024, 1) for _ in range(1000)], 16)
    start = time.perf_counter()
    for trace in (hashed, plain):
        for i in range(1000):
            trace.prompt_token_ids(i, VOCAB)
    assert time.perf_counter() - start < 1.0


# --- synthetic workloads ---------------------------------------------------------------------------


def test_synthetic_is_deterministic_per_seed() -> None:
    kwargs = dict(
        num_prefix_groups=4, prefix_len=32, tenants={"a": 1.0, "b": 2.0}, priorities={0: 1.0, 1: 1.0}
    )
    assert synthetic(300, 4.0, seed=3, **kwargs) == synthetic(300, 4.0, seed=3, **kwargs)  # type: ignore[arg-type]
    assert synthetic(300, 4.0, seed=3, **kwargs) != synthetic(300, 4.0, seed=4, **kwargs)  # type: ignore[arg-type]
    # Each aspect has its own random stream: tenants do not move arrivals or lengths.
    plain, with_tenants = synthetic(300, 4.0, seed=3), synthetic(300, 4.0, seed=3, tenants={"x": 1.0})
    assert [(r.arrival_s, r.prompt_len) for r in plain.requests] == [
        (r.arrival_s, r.prompt_len) for r in with_tenants.requests
    ]


def gaps(trace: Trace) -> np.ndarray:
    return np.diff([r.arrival_s for r in trace.requests])


def test_synthetic_rate_and_burstiness() -> None:
    poisson = synthetic(5000, 20.0, seed=0)
    assert poisson.requests[0].arrival_s == 0.0
    assert (len(poisson) - 1) / poisson.duration_s == pytest.approx(20.0, rel=0.1)
    bursty = synthetic(5000, 20.0, burstiness=0.25, seed=0)
    assert (len(bursty) - 1) / bursty.duration_s == pytest.approx(20.0, rel=0.1)
    cv = {name: g.std() / g.mean() for name, g in (("poisson", gaps(poisson)), ("bursty", gaps(bursty)))}
    assert cv["poisson"] == pytest.approx(1.0, rel=0.1) and cv["bursty"] > 1.5
    assert synthetic(10, float("inf")).duration_s == 0.0


@pytest.mark.parametrize("dist", ["lognormal", "uniform"])
def test_synthetic_lengths_stay_in_range(dist: str) -> None:
    trace = synthetic(2000, 1.0, prompt_len=(100, 900), output_len=(1, 50), length_dist=dist, seed=5)
    prompts = np.array([r.prompt_len for r in trace.requests])
    outputs = np.array([r.output_len for r in trace.requests])
    assert prompts.min() >= 100 and prompts.max() <= 900 and outputs.min() >= 1 and outputs.max() <= 50
    if dist == "lognormal":  # centred on the geometric mean, 300
        assert 250 < np.median(prompts) < 350
    else:
        assert 450 < np.median(prompts) < 550


def test_synthetic_prefix_groups_share_their_prefix() -> None:
    trace = synthetic(200, 1.0, prompt_len=(96, 400), num_prefix_groups=3, prefix_len=64, seed=6)
    prefixes: dict[tuple[int, ...], list[int]] = {}
    all_hashes: list[int] = []
    for i, r in enumerate(trace.requests):
        assert r.block_hashes is not None and len(r.block_hashes) == r.prompt_len // 16
        ids = trace.prompt_token_ids(i, VOCAB)
        group_prefix = prefixes.setdefault(r.block_hashes[:4], ids[:64])
        assert ids[:64] == group_prefix
        all_hashes.extend(r.block_hashes[4:])
    assert len(prefixes) == 3
    assert len(all_hashes) == len(set(all_hashes))  # the rest of each prompt is its own
    assert not set(all_hashes) & {h for key in prefixes for h in key}
    # Different groups, different prefixes.
    assert len({tuple(p) for p in prefixes.values()}) == 3


def test_synthetic_tenants_and_priorities_follow_weights() -> None:
    trace = synthetic(4000, 1.0, tenants={"gold": 1.0, "free": 3.0}, priorities={0: 9.0, 5: 1.0}, seed=7)
    tenants = Counter(r.tenant for r in trace.requests)
    priorities = Counter(r.priority for r in trace.requests)
    assert tenants["free"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert priorities[5] / 4000 == pytest.approx(0.1, abs=0.02) and set(priorities) == {0, 5}
    plain = synthetic(10, 1.0)
    assert all(r.tenant is None and r.priority == 0 and r.block_hashes is None for r in plain.requests)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0}, "rate"),
        ({"burstiness": -1.0}, "burstiness"),
        ({"prompt_len": (10, 5)}, "prompt_len"),
        ({"output_len": (-1, 5)}, "output_len"),
        ({"length_dist": "zipf"}, "length_dist"),
        ({"num_prefix_groups": 2}, "prefix_len"),
        ({"num_prefix_groups": 2, "prefix_len": 24}, "multiple of hash_block_tokens"),
        ({"num_prefix_groups": 2, "prefix_len": 128, "prompt_len": (64, 200)}, "shortest prompt_len"),
        ({"tenants": {"a": -1.0}}, "tenants"),
        ({"priorities": {}}, "priorities"),
    ],
)
def test_synthetic_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"num_requests": 10, "rate": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        synthetic(**args)


# --- load levels -----------------------------------------------------------------------------------


def test_scale_rate_compresses_and_stretches_arrivals() -> None:
    trace = load_mooncake(MOONCAKE_SAMPLE)
    faster = scale_rate(trace, 2.0)
    assert faster.duration_s == pytest.approx(trace.duration_s / 2)
    assert [r.arrival_s for r in faster.requests] == pytest.approx([r.arrival_s / 2 for r in trace.requests])
    assert [(r.prompt_len, r.block_hashes) for r in faster.requests] == [
        (r.prompt_len, r.block_hashes) for r in trace.requests
    ]
    assert (faster.hash_block_tokens, faster.name) == (trace.hash_block_tokens, trace.name)
    assert scale_rate(trace, 0.5).duration_s == pytest.approx(trace.duration_s * 2)
    with pytest.raises(ValueError, match="factor"):
        scale_rate(trace, 0.0)
