"""4-bit weights vs int8 vs float: one stream's decode speed (c=1) and 32 streams' output throughput
(c=32), offline `LLM.generate`, plus the 4-bit layer products alone (`--layers`).

The model is the 415M-parameter random Llama of benchmarks/peers/make_checkpoint.py (built once under
`--cache-dir`), written as a GPTQ 4-bit checkpoint (symmetric, groups of 128) by
tandem/checkpoints/quantize.py. Variants: `float` (dtype auto: float32, or bfloat16 on AMX /
AVX512-BF16 CPUs), `int8` (the float checkpoint quantized at load), `int4` (the GPTQ checkpoint, its
LM head in float as GPTQ tools leave it) and `int4+int8` (the same with `quantization="int8"`: the
head quantized to int8 at load, as the `int8` variant's is).

    python benchmarks/int4.py                       # the 415M model: c=1 and c=32, ~10 minutes
    python benchmarks/int4.py --layers              # also time the linear paths per layer shape
    python benchmarks/int4.py --quick               # a tiny model and few tokens: a smoke test
    python benchmarks/int4.py --perplexity          # accuracy: the default model written as 4-bit

c=1 decode tok/s = decoded tokens / (time of a max_tokens=N+1 run - time of a max_tokens=1 run):
the prompt's pass is taken out; the median of `--repeats` rounds, the variants taking turns (all
loaded at once). Writes benchmarks/results/int4.json (`--result-json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

QUICK_SHAPE = ["--hidden-size", "256", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
               "--intermediate-size", "512", "--vocab-size", "1024"]


def build_checkpoints(args: argparse.Namespace) -> tuple[Path, Path]:
    from tandem.checkpoints.quantize import Scheme, write_quantized

    if args.model is not None:
        float_dir = Path(args.model)
    else:
        float_dir = args.cache_dir / ("llama-quick" if args.quick else "llama-415m")
        if not (float_dir / "config.json").is_file():
            cmd = [sys.executable, str(REPO_ROOT / "benchmarks/peers/make_checkpoint.py"), "--out", str(float_dir)]
            subprocess.run(cmd + (QUICK_SHAPE if args.quick else []), check=True)
    int4_dir = args.cache_dir / f"{float_dir.name}-gptq-g{args.group_size}"
    if not (int4_dir / "config.json").is_file():
        write_quantized(float_dir, int4_dir, Scheme("gptq", args.group_size, sym=True))
    return float_dir, int4_dir


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """The options naming the checkpoints and the c=1 workload (shared with benchmarks/layer_ops.py)."""
    ap.add_argument("--model", default=None, help="a float checkpoint (default: build the 415M one)")
    ap.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "benchmarks/.cache")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(n)]


def one_row_bytes(model: Any) -> int:
    """The weight bytes one decode step of one stream reads: every linear layer's weights (not the
    embedding lookup), and of a layer holding two copies (a float layer's plain and packed
    weights, an int8 layer's kernel and library weights) only the one few rows read."""
    from tandem.model.linear import PackedLinear
    from tandem.model.linear_report import LINEAR_TYPES, linear_path
    from tandem.model.quant import Int8Linear

    total = 0
    for m in model.modules():
        if isinstance(m, PackedLinear) and (m.plain is not None or m.panels is not None):
            few = m.plain if m.plain is not None else m.panels
            total += few.numel() * few.element_size()
        elif isinstance(m, Int8Linear):
            total += sum(t.numel() * t.element_size() for t in (m.qweight, m.panels, m.scale, m.row_sum) if t is not None)
        elif isinstance(m, LINEAR_TYPES):
            total += linear_path(m)[1]
    return total


class Variant:
    """One engine of the comparison, loaded once: its c=1 rounds interleave with the others'."""

    def __init__(self, name: str, folder: Path, engine_args: dict[str, Any], args: argparse.Namespace) -> None:
        from tandem import LLM

        self.name, self.folder, self.engine_args, self.args = name, folder, engine_args, args
        self.llm = LLM(model=str(folder), **engine_args)
        self.model = self.llm.engine.core.runner.model
        vocab = self.model.config.vocab_size
        self.one = prompts(1, args.prompt_len, vocab, 1)
        self.many = prompts(args.concurrency, args.prompt_len, vocab, 2)
        self.decode: list[float] = []
        self.timed(self.one, 4)  # warm-up: first-call costs (oneDNN primitives, allocations)

    def timed(self, batch: list[dict[str, Any]], max_tokens: int) -> float:
        from tandem import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t0

    def decode_round(self) -> None:
        t_prefill = self.timed(self.one, 1)
        t_full = self.timed(self.one, self.args.decode_tokens + 1)
        self.decode.append(self.args.decode_tokens / max(t_full - t_prefill, 1e-9))

    def result(self) -> dict[str, Any]:
        from tandem.model.linear_report import linear_report

        args = self.args
        self.timed(self.many[:4], 2)
        t = self.timed(self.many, args.batch_tokens)
        kinds, weight_bytes = linear_report(self.model)
        return {
            "variant": self.name,
            "checkpoint": str(self.folder),
            "engine_args": self.engine_args,
            "dtype": str(self.llm.engine.core.runner.dtype).removeprefix("torch."),
            "weight_bytes": weight_bytes,
            "linear_bytes": one_row_bytes(self.model),
            "linear_paths": {k: v.path for k, v in kinds.items()},
            "c1_decode_tok_s": sorted(self.decode)[len(self.decode) // 2],
            "c1_decode_tok_s_runs": self.decode,
            f"c{args.concurrency}_output_tok_s": args.concurrency * args.batch_tokens / t,
        }


def time_layers(int4_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each distinct 4-bit layer shape: the kernel, dequantize-then-GEMM per call (the default above
    the kernel's rows) and with the dequantized weight kept, and the float weight's F.linear; where
    the layer holds column panels (AVX512-VNNI without AMX), also the panel kernel."""
    import torch
    import torch.nn.functional as F

    from tandem.config import ModelConfig
    from tandem.kernels import has as kernels_has
    from tandem.model.int4 import Int4Linear
    from tandem.model.loader import load_model

    model = load_model(ModelConfig.from_pretrained(int4_dir), torch.float32, torch.device("cpu"), "torch", 64)
    shapes: dict[tuple[int, int], Int4Linear] = {}
    for m in model.modules():
        if isinstance(m, Int4Linear):
            shapes.setdefault((m.out_features, m.in_features), m)

    def best(f, n: int = 10) -> float:
        f()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    rows_out = []
    for (n, k), lin in shapes.items():
        w = lin.dequantized(torch.float32)
        qw, sc, zs = lin.weight_parts()  # the row layout (rebuilt once where panels replace it)
        gs = lin.group_size
        bufs = {dt: torch.empty(n, k, dtype=dt) for dt in (torch.float32, torch.bfloat16)}

        def dequant(dtype: torch.dtype = torch.float32, qw=qw, sc=sc, zs=zs, gs=gs, bufs=bufs) -> torch.Tensor:
            return torch.ops.tandem.dequant_int4(qw, sc, zs, gs, bufs[dtype])

        for rows in (1, 4, 8, 16, 32, 64, 128, 256, 512):
            x = torch.randn(rows, k)
            xb = x.to(torch.bfloat16)

            def kernel(x: torch.Tensor = x, qw=qw, sc=sc, zs=zs, gs=gs) -> torch.Tensor:
                return torch.ops.tandem.gemm_int4(x, qw, sc, zs, gs, None)

            def panels(x: torch.Tensor = x, lin: Int4Linear = lin) -> torch.Tensor:
                return torch.ops.tandem.gemm_int4_panels(
                    x, lin.panels, lin.out_features, lin.panel_scales, lin.panel_zs, lin.group_size, None
                )

            def per_call(x: torch.Tensor = x, dequant=dequant) -> torch.Tensor:
                return F.linear(x, dequant(torch.float32))

            def kept(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                return F.linear(x, w)

            # bfloat16 activations, as the engine runs on a CPU with bfloat16: the AMX form and the
            # path it replaces.
            def kernel_bf16(x: torch.Tensor = xb, qw=qw, sc=sc, zs=zs, gs=gs) -> torch.Tensor:
                return torch.ops.tandem.gemm_int4(x, qw, sc, zs, gs, None)

            def panels_bf16(x: torch.Tensor = xb, panels=panels) -> torch.Tensor:
                return panels(x)

            def amx(x: torch.Tensor = xb, qw=qw, sc=sc, zs=zs, gs=gs) -> torch.Tensor:
                return torch.ops.tandem.gemm_amx_int4(x, qw, sc, zs, gs, None)

            def per_call_bf16(x: torch.Tensor = xb, dequant=dequant) -> torch.Tensor:
                return F.linear(x, dequant(torch.bfloat16))

            has_kernel, has_panels = kernels_has("gemm_int4") and rows <= 64, lin.panels is not None
            rows_out.append({
                "shape": [n, k],
                "rows": rows,
                "int4_kernel_ms": best(kernel) if has_kernel else None,
                "int4_panels_ms": best(panels) if has_panels else None,
                "dequant_per_call_gemm_ms": best(per_call),
                "dequant_kept_gemm_ms": best(kept),
                "dequant_alone_ms": best(dequant),
                "bf16_int4_kernel_ms": best(kernel_bf16) if has_kernel else None,
                "bf16_int4_panels_ms": best(panels_bf16) if has_panels else None,
                "bf16_amx_int4_ms": best(amx) if lin.amx_max_rows else None,
                "bf16_dequant_per_call_gemm_ms": best(per_call_bf16),
            })
    return rows_out


def default_model_perplexity(args: argparse.Namespace) -> dict[str, Any]:
    """The embedded default model's held-out perplexity as float32 and written in 4-bit formats
    (groups of 32: its MLP width, 864, has no larger power-of-two divisor), through the prompt path
    (dequantize-then-GEMM) and the decode path (the 4-bit kernel), as docs/default_model.md does
    for int8 (tools/default_model_report.py's scorers)."""
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from default_model_report import held_out_texts, tandem_decode_perplexity, tandem_perplexity

    from tandem.checkpoints import DEFAULT_MODEL_DIR
    from tandem.checkpoints.quantize import Scheme, write_quantized

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    ids: list[int] = []
    for t in held_out_texts(max_files=40):
        ids.extend([*tok.encode(t, add_special_tokens=False), tok.eos_token_id])
    ids_t = torch.tensor(ids)
    folders = {"float32": DEFAULT_MODEL_DIR}
    for name, scheme in (("awq-g32", Scheme("awq", 32)), ("gptq-g32-sym", Scheme("gptq", 32, sym=True))):
        folders[name] = args.cache_dir / f"default-{name}"
        if not (folders[name] / "config.json").is_file():
            write_quantized(DEFAULT_MODEL_DIR, folders[name], scheme)
    out: dict[str, Any] = {}
    for name, folder in folders.items():
        out[name] = {
            "prompt_path": tandem_perplexity(folder, "float32", None, ids_t),
            "decode_path": tandem_decode_perplexity(folder, "float32", None, ids_t),
        }
        print(name, json.dumps(out[name]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--variants", default="float,int8,int4,int4+int8")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=64, help="output tokens per request at c=32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--layers", action="store_true", help="also time the 4-bit layer paths alone")
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens: checks the script runs")
    ap.add_argument("--perplexity", action="store_true", help="only the default model's 4-bit perplexity")
    ap.add_argument("--result-json", type=Path, default=REPO_ROOT / "benchmarks/results/int4.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.decode_tokens, args.concurrency, args.batch_tokens, args.repeats = 8, 4, 4, 1
        args.prompt_len, args.group_size = 16, 64

    import torch

    from tandem.cpu import cpu_flags

    if args.perplexity:
        ppl = default_model_perplexity(args)
        path = args.result_json.with_name("int4_perplexity.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"command": "python benchmarks/int4.py --perplexity", "perplexity": ppl},
                                   indent=2) + "\n")
        print(f"wrote {path}")
        return 0
    float_dir, int4_dir = build_checkpoints(args)
    common: dict[str, Any] = {"max_num_seqs": max(args.concurrency, 1), "num_kv_blocks": 64 + 8 * args.concurrency}
    if args.num_threads:
        common["num_threads"] = args.num_threads
    variants = {
        "float": (float_dir, dict(common)),
        "int8": (float_dir, dict(common, quantization="int8")),
        "int4": (int4_dir, dict(common)),
        # The 4-bit checkpoint with its float layers (the LM head) quantized to int8 at load.
        "int4+int8": (int4_dir, dict(common, quantization="int8")),
    }
    # All engines stay loaded and take their c=1 rounds in turn, so a machine that speeds up or
    # slows down during the run (a shared host) moves every variant alike.
    loaded = [Variant(name, *variants[name], args) for name in args.variants.split(",")]
    for _ in range(args.repeats):
        for v in loaded:
            v.decode_round()
    results = []
    for v in loaded:
        results.append(v.result())
        r = results[-1]
        print(f"{v.name:9s} {r['dtype']:9s} weights {r['weight_bytes'] / 2**20:8.1f} MiB   "
              f"c=1 decode {r['c1_decode_tok_s']:7.2f} tok/s   "
              f"c={args.concurrency} output {r[f'c{args.concurrency}_output_tok_s']:7.2f} tok/s", flush=True)
    by = {r["variant"]: r for r in results}
    ratios = {}
    for name in ("int4", "int4+int8"):
        if name in by and "int8" in by:
            key = f"{name}_over_int8_c1_decode"
            ratios[key] = by[name]["c1_decode_tok_s"] / by["int8"]["c1_decode_tok_s"]
            # The ratio of the bytes streamed per token: what the memory roofline allows.
            bound = by["int8"]["linear_bytes"] / by[name]["linear_bytes"]
            ratios[f"{name}_over_int8_linear_bytes"] = bound
            print(f"{name} / int8 c=1 decode: {ratios[key]:.2f}x (goal >= 1.5x; "
                  f"the bytes streamed per token allow {bound:.2f}x)")
    if "int4" in by and "float" in by:
        ratios["int4_over_float_c1_decode"] = by["int4"]["c1_decode_tok_s"] / by["float"]["c1_decode_tok_s"]
    out: dict[str, Any] = {
        "command": "python benchmarks/int4.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": sorted({"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_bf16", "avx512_bf16"} & cpu_flags()),
                    "torch_threads": torch.get_num_threads()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "ratios": ratios,
    }
    if args.layers:
        out["layers"] = time_layers(int4_dir, args)
        for row in out["layers"]:
            print(json.dumps(row))
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
