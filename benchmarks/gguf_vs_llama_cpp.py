#!/usr/bin/env python
"""Tandem and llama.cpp's `llama-server` serving the same GGUF file, side by side (issue 43).

The file is SmolLM2-135M-Instruct Q4_1 by default (`tandem pull smollm2-135m-instruct`); any GGUF
file or pulled model's name works (`--model`). Tandem keeps its 4-bit blocks packed
(`--quantization gguf`, the `tandem-gguf` system of benchmarks/peers/run_peers.py), llama.cpp reads
the same file; each server runs alone, one after the other, driven by `tandem bench serve` with
token-id prompts (the same work for both: llama-server adds BOS to text prompts only). Phases:

1. `throughput`: random prompts of 128 tokens, 128 output tokens (`--ignore-eos`), at
   concurrency 1, 8 and 32: c=1 decode tok/s (1000 / median TPOT) and c=8 / c=32 output tok/s;
2. `ttft`: 1024-token prompts one at a time (1 output token): TTFT;
3. with `--vllm`: Tandem in bfloat16 from the same file (every tensor dequantized at load) against
   vLLM CPU on the checkpoint transformers dequantizes the file to (made here under
   --out-dir/dequantized; `--vllm-gguf` gives vLLM the GGUF file itself instead), same workload as 1.

Writes OUT/<phase>/ (run_peers.py's per-system results, comparison.json/.md) and OUT/summary.json:
per system the four figures, the ratios Tandem / llama.cpp, and the issue's goals (>= 1.3x at c=1,
>= 3x at c=32, TTFT at most llama.cpp's). Run it on an otherwise idle machine:

    tandem pull smollm2-135m-instruct
    PEERS=$HOME/peers bash ../shared/peers/build_llama_cpp.sh     # llama-server, ~10 min
    python benchmarks/gguf_vs_llama_cpp.py \\
        --llama-server $HOME/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server \\
        --out-dir benchmarks/results/gguf-vs-llama-cpp
    python benchmarks/gguf_vs_llama_cpp.py --quick ...             # a smoke test: few requests

`--systems` adds Tandem variants (`tandem-gguf-int8`: also its 8-bit/float layers, the tied LM head
here, as int8); `--dtype` is the activations' dtype of the Tandem systems (default: what
dtype auto picks on this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE.parent))

import run_peers  # noqa: E402 (benchmarks/peers/run_peers.py)

from tandem.cpu import cpu_flags, cpu_model  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
LLAMA = "llamacpp-gguf"  # run_peers' system name for --gguf gguf=PATH
# (concurrency, requests) of each phase; --quick shrinks them.
THROUGHPUT_LEVELS = [(1, 8), (8, 32), (32, 96)]
QUICK_LEVELS = [(1, 2), (8, 8), (32, 32)]
TTFT_LEVEL = (1, 8)
QUICK_TTFT_LEVEL = (1, 2)
THROUGHPUT_WORKLOAD = ["--dataset", "random", "--input-len", "128", "--output-len", "128", "--ignore-eos"]
QUICK_WORKLOAD = ["--dataset", "random", "--input-len", "32", "--output-len", "16", "--ignore-eos"]
TTFT_WORKLOAD = ["--dataset", "random", "--input-len", "1024", "--output-len", "1", "--ignore-eos"]
# The goals: Tandem / llama.cpp.
GOAL_C1 = 1.3
GOAL_C32 = 3.0


def resolve(model: str) -> tuple[Path, Path]:
    """(the GGUF file, the folder Tandem prepared from it: the client's tokenizer)."""
    from tandem.checkpoints.resolve import resolve_model

    ref = resolve_model(model)
    if ref.gguf_file is None:
        raise SystemExit(f"{model!r} is not a GGUF file or a pulled model's name")
    return Path(ref.gguf_file), Path(ref.path)


def auto_dtype() -> str:
    import torch

    from tandem.model.loader import auto_dtype as pick

    return pick(torch.device("cpu"))[0]


def run_phase(
    name: str,
    out: Path,
    args: argparse.Namespace,
    systems: list[str],
    model: Path,
    levels: list[tuple[int, int]],
    workload: list[str],
    extra: list[str] | None = None,
) -> dict[str, Any]:
    """run_peers.py over `systems`; its comparison.json."""
    folder = out / name
    argv = [
        "--model", str(model), "--tokenizer", str(args.tokenizer_dir), "--systems", ",".join(systems),
        "--threads", str(args.threads), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--levels", ",".join(f"{c}:{n}" for c, n in levels), "--max-num-seqs", str(max(c for c, _ in levels)),
        "--out-dir", str(folder), *(extra or []), "--", *workload,
    ]  # fmt: skip
    if args.llama_server:
        argv[:0] = ["--llama-server", args.llama_server, "--gguf", f"gguf={model}"]
    run_peers.log(f"phase {name}: {' '.join(argv)}")
    run_peers.main(argv)  # a failed system is recorded as skipped; the others still run
    return json.loads((folder / "comparison.json").read_text())


def figure(table: dict[str, Any] | None, system: str, column: str) -> float | None:
    if table is None:
        return None
    row = table["systems"].get(system, {})
    value = row.get(column)
    return float(value) if isinstance(value, (int, float)) else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(throughput: dict[str, Any], ttft: dict[str, Any] | None, systems: list[str]) -> dict[str, Any]:
    tables = throughput["tables"]
    c1, c8, c32 = (tables.get(str(c)) for c in (1, 8, 32))
    ttft_table = ttft["tables"].get(str(TTFT_LEVEL[0])) if ttft else None
    rows: dict[str, dict[str, float | None]] = {}
    for name in systems:
        rows[name] = {
            "c1_decode_tok_s": figure(c1, name, "decode tok/s"),
            "c8_output_tok_s": figure(c8, name, "out tok/s"),
            "c32_output_tok_s": figure(c32, name, "out tok/s"),
            "ttft_1024_ms": figure(ttft_table, name, "TTFT med ms"),
        }
    out: dict[str, Any] = {"systems": rows}
    llama = rows.get(LLAMA)
    if llama is not None:
        out["vs_llama_cpp"] = {
            name: {key: ratio(value, llama[key]) for key, value in row.items()}
            for name, row in rows.items()
            if name != LLAMA
        }
        goals = {}
        for name, r in out["vs_llama_cpp"].items():
            goals[name] = {
                f"c1 >= {GOAL_C1}x": None
                if r["c1_decode_tok_s"] is None
                else r["c1_decode_tok_s"] >= GOAL_C1,
                f"c32 >= {GOAL_C32}x": None
                if r["c32_output_tok_s"] is None
                else r["c32_output_tok_s"] >= GOAL_C32,
                # Lower is better: Tandem's TTFT over llama.cpp's at most 1.
                "ttft <= llama.cpp": None if r["ttft_1024_ms"] is None else r["ttft_1024_ms"] <= 1.0,
            }
        out["goals"] = goals
    return out


def dequantized_checkpoint(gguf: Path, out: Path) -> Path:
    """The file as a bfloat16 safetensors checkpoint, dequantized by transformers (vLLM's input)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers marks a model read from GGUF as quantized ("gguf", not serializable); its weights
    # are plain dequantized tensors by now, saved as such.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file or a pulled model's name")
    p.add_argument("--llama-server", default=None, help="llama-server binary (build_llama_cpp.sh)")
    p.add_argument("--systems", default="tandem-gguf", help="Tandem systems of run_peers.py, comma-separated")
    p.add_argument(
        "--dtype", default=None, choices=run_peers.DTYPES, help="Tandem's activations (default: auto's)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--phases", default="throughput,ttft", help="throughput, ttft (comma-separated)")
    p.add_argument("--vllm", action="store_true", help="also Tandem bf16 vs vLLM CPU (phase 3)")
    p.add_argument("--vllm-gguf", action="store_true", help="phase 3: vLLM loads the GGUF file itself")
    p.add_argument(
        "--quick", action="store_true", help="few, short requests: checks the setup, times nothing"
    )
    p.add_argument("--out-dir", type=Path, default=Path("gguf-vs-llama-cpp"))
    args = p.parse_args(argv)
    gguf, args.tokenizer_dir = resolve(args.model)
    args.dtype = args.dtype or auto_dtype()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tandem = [s.strip() for s in args.systems.split(",") if s.strip()]
    systems = tandem + ([LLAMA] if args.llama_server else [])
    if not args.llama_server:
        run_peers.log("note: no --llama-server: Tandem alone")
    levels = QUICK_LEVELS if args.quick else THROUGHPUT_LEVELS
    workload = QUICK_WORKLOAD if args.quick else THROUGHPUT_WORKLOAD
    phases = {s.strip() for s in args.phases.split(",")}
    results: dict[str, Any] = {}
    if "throughput" in phases:
        results["throughput"] = run_phase("throughput", args.out_dir, args, systems, gguf, levels, workload)
    if "ttft" in phases:
        ttft_level = QUICK_TTFT_LEVEL if args.quick else TTFT_LEVEL
        results["ttft"] = run_phase("ttft", args.out_dir, args, systems, gguf, [ttft_level], TTFT_WORKLOAD,
                                    ["--llama-ctx", str(4 * args.max_model_len)])  # fmt: skip
    if args.vllm:
        vllm_model = gguf if args.vllm_gguf else dequantized_checkpoint(gguf, args.out_dir / "dequantized")
        bf16 = argparse.Namespace(**{**vars(args), "dtype": "bfloat16", "llama_server": None})
        results["bf16_vs_vllm"] = run_phase("bf16_vs_vllm", args.out_dir, bf16, ["tandem", "vllm"], gguf,
                                            levels, workload, ["--vllm-model", str(vllm_model)])  # fmt: skip
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu_model(), "amx": "amx_bf16" in cpu_flags(), "threads": args.threads},
        "model": str(gguf),
        "tandem_dtype": args.dtype,
        "quick": args.quick,
        "workload": {"throughput": " ".join(workload), "ttft": " ".join(TTFT_WORKLOAD)},
    }
    if "throughput" in results:
        summary["gguf"] = summarize(results["throughput"], results.get("ttft"), systems)
    if "bf16_vs_vllm" in results:
        summary["bf16_vs_vllm"] = summarize(results["bf16_vs_vllm"], None, ["tandem", "vllm"])
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
