"""Grammar engines compared on the default model's vocabulary and on a ~128k one: how long a
grammar takes to compile and how long one token's mask takes, for xgrammar and llguidance.

    python benchmarks/grammar_backends.py [--out benchmarks/results/grammar_backends.json]

The 128k tokenizer is a byte-level BPE trained on the Python sources installed beside this
interpreter (no download), cached under ~/.cache/tandem-bench/. The per-token figure walks a valid
output token by token, timing the mask before each token (what the engine does every step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "admin": {"type": "boolean"},
        "role": {"enum": ["reader", "writer", "owner"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["street", "city"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
SAMPLE = {
    "name": "Ada Lovelace of the analytical engine",
    "age": 36,
    "admin": True,
    "role": "owner",
    "tags": ["math", "poetry", "engines", "notes"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": 10001},
}
REGEX = r"(\+\d{1,3} )?\(\d{3}\) \d{3}-\d{4}"
REGEX_SAMPLE = "+44 (020) 555-0199"


def tokenizer_128k(cache: Path) -> Any:
    """A ~128k-token byte-level BPE trained on local Python sources (built once, then cached)."""
    from transformers import PreTrainedTokenizerFast

    from tandem.checkpoints.bpe import train_bpe_tokenizer

    if (cache / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(cache))
    roots = [Path(p) for p in sys.path if p.endswith("site-packages")]

    def texts() -> Iterator[str]:
        budget = 60_000_000  # characters: enough distinct words and fragments for 128k merges
        for root in roots:
            for f in sorted(root.rglob("*.py")):
                try:
                    text = f.read_text(errors="ignore")
                except OSError:
                    continue
                budget -= len(text)
                yield text
                if budget <= 0:
                    return

    cache.mkdir(parents=True, exist_ok=True)
    return train_bpe_tokenizer(texts(), 128_000, cache)


def timed(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def bench_xgrammar(hf_tok: Any, vocab: int, eos: int, cases: dict[str, tuple[str, Any, str]]) -> dict[str, Any]:
    import xgrammar as xgr

    out: dict[str, Any] = {}
    t, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=[eos]), 1)
    out["tokenizer_s"] = t
    for name, (kind, spec, text) in cases.items():

        def compile_once(kind: str = kind, spec: Any = spec) -> Any:
            # A fresh compiler each time: the figure is a cold compile, not a cache hit.
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            if kind == "json":
                return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_regex(spec)

        t, compiled = timed(compile_once)
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        mask_np = mask.numpy()
        per_token = []
        for tok in [*hf_tok.encode(text, add_special_tokens=False), eos]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            per_token.append(time.perf_counter() - t0)
            allowed = bool((mask_np[0, tok // 32] >> (tok % 32)) & 1)
            if not allowed or not matcher.accept_token(tok):
                raise RuntimeError(f"xgrammar rejected a valid {name} output at token {tok}")
        out[name] = {"compile_s": t, **summary(per_token)}
    return out


def bench_llguidance(hf_tok: Any, vocab: int, eos: int, cases: dict[str, tuple[str, Any, str]]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    out: dict[str, Any] = {}
    t, tok = timed(lambda: llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos), 1)
    out["tokenizer_s"] = t
    for name, (kind, spec, text) in cases.items():
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(spec), defaults={"whitespace_flexible": False}
            )
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)

        def compile_once(grammar: str = grammar) -> Any:
            m = llguidance.LLMatcher(tok, grammar)
            if m.is_error():
                raise RuntimeError(m.get_error())
            return m

        t, matcher = timed(compile_once)
        mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
        per_token = []
        for token in [*hf_tok.encode(text, add_special_tokens=False), eos]:
            t0 = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            per_token.append(time.perf_counter() - t0)
            allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
            if not allowed or not matcher.consume_token(token):
                raise RuntimeError(f"llguidance rejected a valid {name} output at token {token}")
        out[name] = {"compile_s": t, **summary(per_token)}
    return out


def summary(seconds: list[float]) -> dict[str, float | int]:
    ordered = sorted(seconds)
    return {
        "tokens": len(seconds),
        "mask_mean_us": statistics.fmean(seconds) * 1e6,
        "mask_p50_us": ordered[len(ordered) // 2] * 1e6,
        "mask_max_us": ordered[-1] * 1e6,
        "first_mask_us": seconds[0] * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/grammar_backends.json")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "tandem-bench" / "bpe-128k"))
    args = ap.parse_args()

    from transformers import PreTrainedTokenizerFast

    from tandem.checkpoints import default_model_path

    cases = {
        "json_schema": ("json", SCHEMA, json.dumps(SAMPLE, separators=(",", ":"))),
        "json_object": ("json_object", None, json.dumps(SAMPLE, separators=(",", ":"))),
        "regex": ("regex", REGEX, REGEX_SAMPLE),
    }
    t0 = time.perf_counter()
    big = tokenizer_128k(Path(args.cache))
    build_s = time.perf_counter() - t0
    vocabs = {
        "default": PreTrainedTokenizerFast.from_pretrained(default_model_path()),
        "bpe128k": big,
    }
    results: dict[str, Any] = {"tokenizer_128k_build_s": build_s, "vocabularies": {}}
    for label, hf_tok in vocabs.items():
        vocab = len(hf_tok)
        eos = hf_tok.eos_token_id
        entry: dict[str, Any] = {"vocab_size": vocab}
        entry["xgrammar"] = bench_xgrammar(hf_tok, vocab, eos, cases)
        entry["llguidance"] = bench_llguidance(hf_tok, vocab, eos, cases)
        results["vocabularies"][label] = entry
        print(f"\n{label}: vocabulary {vocab}")
        print(f"  {'backend':<11} {'case':<12} {'compile ms':>10} {'mask mean us':>13} {'p50 us':>8} {'max us':>8}")
        for backend in ("xgrammar", "llguidance"):
            b = entry[backend]
            print(f"  {backend:<11} {'tokenizer':<12} {b['tokenizer_s'] * 1e3:>10.1f}")
            for case in cases:
                c = b[case]
                print(
                    f"  {backend:<11} {case:<12} {c['compile_s'] * 1e3:>10.2f} {c['mask_mean_us']:>13.1f} "
                    f"{c['mask_p50_us']:>8.1f} {c['mask_max_us']:>8.1f}"
                )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
