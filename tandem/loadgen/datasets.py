"""Benchmark workloads: random, sharegpt-like, prefix-repetition, code, file (JSONL).

Each sample has a text prompt (for HTTP servers), optionally its token ids (for the offline
benchmark, when a tokenizer is given), the prompt length in tokens (approximate without a
tokenizer: CHARS_PER_TOKEN characters per token) and the number of output tokens to ask for.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "sharegpt-like", "prefix-repetition", "code", "file", "trace")
CHARS_PER_TOKEN = 4
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "token",
    "cache",
    "batch",
    "server",
    "request",
    "latency",
    "stream",
    "queue",
    "engine",
    "block",
    "prefix",
    "decode",
    "sample",
]


@dataclass
class Sample:
    prompt: str
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    # A replayed trace: when to send it (seconds from the run's start), and send the ids themselves
    # (the prompt text would tokenize back to other lengths).
    arrival_s: float | None = None
    send_ids: bool = False


def load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    from tandem.checkpoints.resolve import resolve_model

    # A pulled model's name or a GGUF file: the tokenizer of the folder prepared from it.
    return AutoTokenizer.from_pretrained(resolve_model(path).path)


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    """Uniform integers in [mean*(1-r), mean*(1+r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def _special_ids(tok: Any) -> set[int]:
    return set(getattr(tok, "all_special_ids", []) or [])


def _random_text(rng: np.random.Generator, length: int, tok: Any) -> tuple[str, list[int] | None]:
    """A prompt of about `length` tokens: decoded random token ids, or random words without a tokenizer."""
    if tok is None:
        words: list[str] = []
        size = 0
        while size < length * CHARS_PER_TOKEN:
            w = _WORDS[int(rng.integers(len(_WORDS)))]
            words.append(w)
            size += len(w) + 1
        return " ".join(words)[: length * CHARS_PER_TOKEN], None
    special = _special_ids(tok)
    vocab = len(tok)
    ids = [int(i) for i in rng.integers(0, vocab, size=length * 2) if int(i) not in special][:length]
    while len(ids) < length:
        i = int(rng.integers(0, vocab))
        if i not in special:
            ids.append(i)
    text = tok.decode(ids)
    # Re-encoding decoded text may not give the same ids; token ids stay the exact offline prompt.
    return text, ids


def _from_text(text: str, start: int, length: int, tok: Any) -> tuple[str, list[int] | None]:
    """`length` tokens of `text` starting near character `start` (characters without a tokenizer)."""
    if tok is None:
        piece = text[start : start + length * CHARS_PER_TOKEN]
        return piece, None
    ids = tok.encode(text[start : start + length * CHARS_PER_TOKEN * 3], add_special_tokens=False)[:length]
    return tok.decode(ids), list(ids)


def _finish(text: str, ids: list[int] | None, length: int, output_len: int) -> Sample:
    return Sample(text, len(ids) if ids is not None else length, int(output_len), ids)


def random_dataset(
    n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0, tokenizer: Any = None
) -> list[Sample]:
    rng = np.random.default_rng(seed)
    ins = _lengths(rng, input_len, range_ratio, n)
    outs = _lengths(rng, output_len, range_ratio, n)
    out = []
    for i, o in zip(ins, outs):
        text, ids = _random_text(rng, int(i), tokenizer)
        out.append(_finish(text, ids, int(i), int(o)))
    return out


def sharegpt_like_dataset(
    n: int,
    seed: int = 0,
    tokenizer: Any = None,
    input_mean: int = 256,
    output_mean: int = 128,
    sigma: float = 0.9,
    max_len: int = 1024,
) -> list[Sample]:
    """Chat-like heavy-tailed lengths without a download: lognormal prompt and output lengths
    (median input_mean/output_mean), clipped to [4, max_len] and [1, max_len]."""
    rng = np.random.default_rng(seed)
    ins = np.clip(np.round(rng.lognormal(np.log(input_mean), sigma, size=n)), 4, max_len).astype(int)
    outs = np.clip(np.round(rng.lognormal(np.log(output_mean), sigma, size=n)), 1, max_len).astype(int)
    out = []
    for i, o in zip(ins, outs):
        text, ids = _random_text(rng, int(i), tokenizer)
        out.append(_finish(text, ids, int(i), int(o)))
    return out


def prefix_repetition_dataset(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    tokenizer: Any = None,
) -> list[Sample]:
    """`num_prefixes` shared prefixes, each request one of them (round robin, shuffled) plus a unique suffix."""
    if num_prefixes < 1:
        raise ValueError("--num-prefixes must be at least 1")
    rng = np.random.default_rng(seed)
    prefixes = [_random_text(rng, prefix_len, tokenizer) for _ in range(num_prefixes)]
    order = rng.permutation([i % num_prefixes for i in range(n)])
    out = []
    for p in order:
        ptext, pids = prefixes[int(p)]
        stext, sids = _random_text(rng, suffix_len, tokenizer)
        if pids is not None and sids is not None:
            ids = pids + sids
            out.append(Sample(ptext + stext, len(ids), output_len, ids))
        else:
            out.append(Sample(ptext + " " + stext, prefix_len + suffix_len, output_len))
    return out


def stdlib_sources(limit: int = 200) -> list[Path]:
    """Python standard-library source files, sorted (the same set on every run)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.is_file())
    files = [p for p in files if p.stat().st_size > 4000]
    return files[:limit] or sorted(Path(os.__file__).parent.glob("*.py"))[:limit]


def code_dataset(
    n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0, tokenizer: Any = None
) -> list[Sample]:
    """Prompts cut from Python stdlib source files at seeded random offsets."""
    rng = np.random.default_rng(seed)
    files = stdlib_sources()
    ins = _lengths(rng, input_len, range_ratio, n)
    outs = _lengths(rng, output_len, range_ratio, n)
    cache: dict[Path, str] = {}
    out = []
    for i, o in zip(ins, outs):
        path = files[int(rng.integers(len(files)))]
        text = cache.setdefault(path, path.read_text(errors="ignore"))
        need = int(i) * CHARS_PER_TOKEN * 3
        while len(text) < need + 1:
            text = text + "\n" + text
        start = int(rng.integers(0, max(1, len(text) - need)))
        piece, ids = _from_text(text, start, int(i), tokenizer)
        out.append(_finish(piece, ids, int(i), int(o)))
    return out


def file_dataset(
    path: str, n: int | None = None, tokenizer: Any = None, output_len: int = 128
) -> list[Sample]:
    """JSONL: one object a line with `prompt` (and optionally `output_len`)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row["prompt"]
            ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else None
            length = len(ids) if ids is not None else max(1, len(prompt) // CHARS_PER_TOKEN)
            out.append(Sample(prompt, length, int(row.get("output_len", output_len)), ids))
            if n is not None and len(out) >= n:
                break
    if not out:
        raise ValueError(f"no prompts in {path}")
    if n is not None and len(out) < n:  # cycle to the requested count
        out = [out[i % len(out)] for i in range(n)]
    return out


def trace_dataset(path: str, n: int | None, tokenizer: Any) -> list[Sample]:
    """A trace replayed as recorded: each request's arrival time, prompt and output lengths, and
    prompt token ids built as the simulator builds them (tandem/sim/trace.py), shared prefixes
    included, so a real run and a simulation see the same requests."""
    from tandem.sim.trace import load_trace

    trace = load_trace(path)
    vocab = tokenizer.vocab_size if tokenizer is not None else 32000
    out = []
    for i, r in enumerate(trace.requests[:n]):
        ids = trace.prompt_token_ids(i, vocab)
        out.append(Sample("", r.prompt_len, r.output_len, ids, arrival_s=r.arrival_s, send_ids=True))
    return out


def add_dataset_args(p: argparse.ArgumentParser, with_seed: bool = True) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=DATASETS, help="where the prompts come from")
    g.add_argument(
        "--dataset-path", default=None, help="JSONL with `prompt` and `output_len` (--dataset file); a trace file (--dataset trace)"
    )
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    g.add_argument("--input-len", type=int, default=256, help="prompt tokens (random)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens asked for (random)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±r)")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared prefixes (prefix-repetition)")
    g.add_argument("--prefix-len", type=int, default=256, help="tokens of each prefix (prefix-repetition)")
    g.add_argument("--suffix-len", type=int, default=32, help="tokens after the prefix (prefix-repetition)")
    if with_seed:
        g.add_argument("--seed", type=int, default=0, help="seed of the dataset")


def build_dataset(args: argparse.Namespace, n: int, tokenizer: Any, seed: int | None = None) -> list[Sample]:
    seed = args.seed if seed is None else seed
    if args.dataset == "random":
        return random_dataset(n, args.input_len, args.output_len, args.range_ratio, seed, tokenizer)
    if args.dataset == "sharegpt-like":
        return sharegpt_like_dataset(n, seed, tokenizer, args.input_len, args.output_len)
    if args.dataset == "prefix-repetition":
        return prefix_repetition_dataset(
            n, args.num_prefixes, args.prefix_len, args.suffix_len, args.output_len, seed, tokenizer
        )
    if args.dataset == "code":
        return code_dataset(n, args.input_len, args.output_len, args.range_ratio, seed, tokenizer)
    if args.dataset == "file":
        if not args.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        return file_dataset(args.dataset_path, n, tokenizer, args.output_len)
    if args.dataset == "trace":
        if not args.dataset_path:
            raise ValueError("--dataset trace needs --dataset-path (Azure CSV, Mooncake or Tandem JSONL)")
        return trace_dataset(args.dataset_path, n, tokenizer)
    raise ValueError(f"unknown dataset {args.dataset!r}")
