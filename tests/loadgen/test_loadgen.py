"""`tandem bench` pure parts: percentiles, latencies from chunk timestamps, goodput, arrivals, datasets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tandem.loadgen import datasets as D
from tandem.loadgen import latency_stats as M
from tandem.loadgen.arrivals import arrival_intervals
from tandem.loadgen.server_counters import counter_deltas, parse_prometheus, server_counters


def test_percentile_matches_linear_interpolation():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert M.percentile(values, 50) == pytest.approx(5.5)
    assert M.percentile(values, 90) == pytest.approx(9.1)
    assert M.percentile(values, 99) == pytest.approx(9.91)
    assert M.percentile([], 50) == 0.0
    s = M.stats([0.001, 0.002, 0.003])  # seconds -> ms
    assert s["mean"] == pytest.approx(2.0)
    assert s["median"] == pytest.approx(2.0)
    assert set(s) == {"mean", "std", "median", "p90", "p99"}


def _result(chunks, tokens=None, e2el=None, prompt_len=10):
    r = M.RequestResult(success=True, prompt_len=prompt_len, chunk_times=list(chunks))
    r.output_tokens = len(chunks) if tokens is None else tokens
    r.e2el = chunks[-1] if e2el is None else e2el
    return M.finish_result(r)


def test_ttft_itl_tpot_from_chunk_timestamps():
    r = _result([0.5, 0.6, 0.8, 0.9])
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.1])
    assert r.tpot == pytest.approx((0.9 - 0.5) / 3)
    one = _result([0.3])
    assert one.itl == [] and one.tpot == 0.0
    # More tokens than chunks (a chunk may carry several): TPOT counts tokens, ITL counts chunks.
    multi = _result([0.2, 0.4], tokens=5, e2el=0.4)
    assert multi.tpot == pytest.approx(0.2 / 4)
    assert multi.itl == pytest.approx([0.2])


def test_summarize_throughput_and_latency_stats():
    results = [_result([0.1, 0.2, 0.3]), _result([0.2, 0.4, 0.6]), M.RequestResult(success=False)]
    s = M.summarize(results, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["median"] == pytest.approx(150.0)
    assert s["e2el_ms"]["p99"] == pytest.approx(300 + 0.99 * 300)
    assert s["goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    fast = _result([0.05, 0.06, 0.07])
    slow_first = _result([0.5, 0.51, 0.52])
    slow_decode = _result([0.05, 0.3, 0.6])
    slo = M.parse_goodput(["ttft:100", "tpot:50"])
    assert slo == {"ttft": pytest.approx(0.1), "tpot": pytest.approx(0.05)}
    s = M.summarize([fast, slow_first, slow_decode], duration=1.0, slo=slo)
    assert s["goodput"]["good_requests"] == 1
    assert s["goodput"]["request_goodput"] == pytest.approx(1.0)
    assert s["goodput"]["slo_ms"]["ttft"] == pytest.approx(100)
    assert M.parse_goodput(["e2el:1000 ttft:10"]) == {"e2el": 1.0, "ttft": 0.01}
    with pytest.raises(ValueError):
        M.parse_goodput(["latency:5"])
    with pytest.raises(ValueError):
        M.parse_goodput(["ttft:-1"])


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_requested_mean_rate(burstiness):
    gaps = np.array(list(arrival_intervals(10.0, burstiness, seed=1, n=20000)))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # gamma: coefficient of variation = 1/sqrt(shape) (Poisson: exponential gaps, CV 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    again = list(arrival_intervals(10.0, burstiness, seed=1, n=50))
    assert again == list(gaps[:50])


def test_infinite_rate_sends_at_once():
    assert list(arrival_intervals(math.inf, 1.0, n=5)) == [0.0] * 5
    with pytest.raises(ValueError):
        next(arrival_intervals(1.0, 0.0))


def test_prometheus_parsing_and_counter_deltas():
    before_text = """# HELP x
tandem:prefix_cache_queries_total{model_name="m"} 100.0
tandem:prefix_cache_hits_total{model_name="m"} 20.0
tandem:spec_decode_num_draft_tokens_total{model_name="m"} 0.0
tandem:spec_decode_num_accepted_tokens_total{model_name="m"} 0.0
tandem:num_preemptions_total{model_name="m"} 1.0
tandem:num_swap_outs_total{model_name="m"} 0.0
"""
    after_text = """tandem:prefix_cache_queries_total{model_name="m"} 300.0
tandem:prefix_cache_hits_total{model_name="m"} 120.0
tandem:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
tandem:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0
tandem:num_preemptions_total{model_name="m"} 3.0
tandem:num_swap_outs_total{model_name="m"} 2.0
"""
    before = server_counters(parse_prometheus(before_text))
    after = server_counters(parse_prometheus(after_text))
    d = counter_deltas(before, after)
    assert d["prefix_cache_queries"] == 200 and d["prefix_cache_hits"] == 100
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert d["spec_decode_acceptance_rate"] == pytest.approx(0.75)
    assert d["preemptions"] == 2 and d["swap_outs"] == 2
    vllm = server_counters(parse_prometheus('vllm:prefix_cache_hits_total{engine="0"} 7\n'))
    assert vllm == {"prefix_cache_hits": 7.0}
    assert counter_deltas(None, after) == {}


# --- datasets --------------------------------------------------------------------------------------


def test_random_dataset_lengths_in_range_and_seeded(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    a = D.random_dataset(30, input_len=40, output_len=10, range_ratio=0.5, seed=3, tokenizer=tok)
    b = D.random_dataset(30, input_len=40, output_len=10, range_ratio=0.5, seed=3, tokenizer=tok)
    c = D.random_dataset(30, input_len=40, output_len=10, range_ratio=0.5, seed=4, tokenizer=tok)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    special = set(tok.all_special_ids)
    for s in a:
        assert 20 <= s.prompt_len <= 60 and len(s.prompt_token_ids) == s.prompt_len
        assert 5 <= s.output_len <= 15
        assert not special & set(s.prompt_token_ids)
        assert isinstance(s.prompt, str) and s.prompt
    fixed = D.random_dataset(5, 16, 4, 0.0, seed=0, tokenizer=tok)
    assert {s.prompt_len for s in fixed} == {16} and {s.output_len for s in fixed} == {4}


def test_random_dataset_without_tokenizer_approximates_by_characters():
    a = D.random_dataset(10, 32, 8, 0.25, seed=0)
    assert a == D.random_dataset(10, 32, 8, 0.25, seed=0)
    for s in a:
        assert 24 <= s.prompt_len <= 40
        assert len(s.prompt) <= s.prompt_len * D.CHARS_PER_TOKEN
        assert s.prompt_token_ids is None


def test_sharegpt_like_is_heavy_tailed_and_clipped():
    a = D.sharegpt_like_dataset(400, seed=0, input_mean=64, output_mean=32, max_len=512)
    ins = np.array([s.prompt_len for s in a])
    outs = np.array([s.output_len for s in a])
    assert ins.min() >= 4 and ins.max() <= 512 and outs.min() >= 1 and outs.max() <= 512
    assert ins.mean() > np.median(ins)  # right-skewed
    again = D.sharegpt_like_dataset(400, seed=0, input_mean=64, output_mean=32, max_len=512)
    assert [s.prompt for s in a] == [s.prompt for s in again]


def test_prefix_repetition_shares_prefixes(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    a = D.prefix_repetition_dataset(
        12, num_prefixes=3, prefix_len=20, suffix_len=5, output_len=7, seed=0, tokenizer=tok
    )
    prefixes = {tuple(s.prompt_token_ids[:20]) for s in a}
    assert len(prefixes) == 3
    assert all(s.prompt_len == 25 and s.output_len == 7 for s in a)
    assert len({tuple(s.prompt_token_ids) for s in a}) == 12


def test_code_dataset_cuts_stdlib_source(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    a = D.code_dataset(6, 50, 8, seed=0, tokenizer=tok)
    assert a == D.code_dataset(6, 50, 8, seed=0, tokenizer=tok)
    assert all(s.prompt_len == 50 for s in a)
    plain = D.code_dataset(6, 50, 8, seed=0)
    assert all(len(s.prompt) == 200 for s in plain)


def test_file_dataset_reads_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"hello {i}", "output_len": i + 1}) for i in range(3)))
    a = D.file_dataset(str(path), n=5)
    assert [s.prompt for s in a] == ["hello 0", "hello 1", "hello 2", "hello 0", "hello 1"]
    assert [s.output_len for s in a] == [1, 2, 3, 1, 2]


def test_cli_parses_bench_subcommands():
    from tandem.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "serve", "--model", "m", "--request-rate", "1,2.5,inf", "--max-concurrency", "4"]
    )
    assert args.request_rate == [1.0, 2.5, math.inf] and args.max_concurrency == [4.0]
    assert args.endpoint == "completions" and args.dataset == "random" and args.burstiness == 1.0
    args = build_parser().parse_args(["bench", "throughput", "--dataset", "code", "--num-prompts", "3"])
    assert args.dataset == "code" and args.num_prompts == 3 and args.seed == 0
    assert build_parser().parse_args(["serve", "x"]).model_tag == "x"


def test_bench_serve_sends_token_ids_when_asked(tokenizer_dir):
    """--send-token-ids: the prompt goes out as the dataset's token ids, so every server prefills
    exactly the same tokens (text would be re-tokenized by each, not always to the same length)."""
    import argparse

    from tandem.loadgen.serve import _payload, add_serve_bench_args, bench_samples

    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    base = ["--num-prompts", "3", "--input-len", "16", "--output-len", "4"]
    args = p.parse_args([*base, "--tokenizer", str(tokenizer_dir), "--send-token-ids"])
    samples, _ = bench_samples(args)
    for s in samples:
        path, body = _payload(args, s)
        assert path == "/v1/completions" and body["prompt"] == s.prompt_token_ids and len(s.prompt_token_ids) == 16
    text = p.parse_args([*base, "--tokenizer", str(tokenizer_dir)])
    assert all(isinstance(_payload(text, s)[1]["prompt"], str) for s in bench_samples(text)[0])
    with pytest.raises(ValueError, match="--tokenizer"):
        bench_samples(p.parse_args([*base, "--send-token-ids"]))


def test_sse_payloads_survive_any_chunking() -> None:
    """The bench client's event splitter: payloads cut across chunks, comments and blank lines
    skipped, a long event whole, nothing after [DONE], a last line without its newline kept."""
    import asyncio
    from collections.abc import AsyncIterator

    from tandem.loadgen.serve import _sse_data

    long_event = b'{"text": "' + b"x" * 200_000 + b'"}'
    stream = b": ping\n\ndata: {\"a\": 1}\n\ndata: " + long_event + b"\n\ndata: [DONE]\n\ndata: {\"after\": 1}\n\n"

    class Content:
        def __init__(self, data: bytes, size: int) -> None:
            self.parts = [data[i : i + size] for i in range(0, len(data), size)]

        async def iter_any(self) -> AsyncIterator[bytes]:
            for part in self.parts:
                yield part

    async def collect(content: Content) -> list[bytes]:
        return [p async for p in _sse_data(content)]

    for size in (1, 7, 4096, len(stream)):
        assert asyncio.run(collect(Content(stream, size))) == [b'{"a": 1}', long_event]
    assert asyncio.run(collect(Content(b'data: {"b": 2}\n\ndata: {"c": 3}', 5))) == [b'{"b": 2}', b'{"c": 3}']
