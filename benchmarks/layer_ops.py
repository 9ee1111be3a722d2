"""The per-token glue kernels (tandem/kernels/layer_ops.cpp: RMSNorm, SiLU-and-multiply, rotary) on
against off: one stream's decode speed (c=1) and 8 streams' output throughput (c=8), offline.

Each variant's engine is loaded once and takes its rounds with the kernels switched on and off in
turn (tandem.model.fused_ops.set_fused_ops), so a machine that drifts moves both sides alike. The
model is the 415M-parameter random Llama of benchmarks/peers/make_checkpoint.py and its GPTQ 4-bit
copy, both built by benchmarks/int4.py under `--cache-dir`. Variants: `int8` (float32 activations,
int8 weights), `int4+int8` (the GPTQ checkpoint, LM head int8) and `bfloat16`. The float32 model
with float weights is not among them: it keeps PyTorch's operators, to stay exactly transformers'.

    python benchmarks/layer_ops.py                 # ~5 minutes
    python benchmarks/layer_ops.py --quick         # a tiny model: checks the script runs

c=1 decode tok/s = decoded tokens / (time of a max_tokens=N+1 run - time of a max_tokens=1 run);
the median of `--repeats` rounds. Writes benchmarks/results/layer_ops.json (`--result-json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.int4 import Variant, add_checkpoint_args, build_checkpoints  # noqa: E402


class Toggled(Variant):
    """A variant of benchmarks/int4.py whose rounds switch the per-token kernels on and off."""

    def __init__(self, name: str, folder: Path, engine_args: dict[str, Any], args: argparse.Namespace) -> None:
        super().__init__(name, folder, engine_args, args)
        self.c1: dict[bool, list[float]] = {True: [], False: []}
        self.batch: dict[bool, list[float]] = {True: [], False: []}

    def round(self, fused: bool) -> None:
        from tandem.model.fused_ops import set_fused_ops

        set_fused_ops(self.model, fused)
        n = self.args.decode_tokens
        t_prefill = self.timed(self.one, 1)
        self.c1[fused].append(n / max(self.timed(self.one, n + 1) - t_prefill, 1e-9))
        tokens = self.args.concurrency * self.args.batch_tokens
        self.batch[fused].append(tokens / self.timed(self.many, self.args.batch_tokens))

    def toggled_result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"variant": self.name}
        c = self.args.concurrency
        for fused, label in ((True, "kernels"), (False, "torch")):
            out[f"{label}_c1_decode_tok_s"] = statistics.median(self.c1[fused])
            out[f"{label}_c{c}_output_tok_s"] = statistics.median(self.batch[fused])
            out[f"{label}_c1_decode_tok_s_runs"] = self.c1[fused]
        out["c1_ratio"] = out["kernels_c1_decode_tok_s"] / out["torch_c1_decode_tok_s"]
        out[f"c{c}_ratio"] = out[f"kernels_c{c}_output_tok_s"] / out[f"torch_c{c}_output_tok_s"]
        out["c1_ratio_runs"] = [a / b for a, b in zip(self.c1[True], self.c1[False])]
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--variants", default="int8,int4+int8,bfloat16")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=32, help="output tokens per request at c>1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens: checks the script runs")
    ap.add_argument("--result-json", type=Path, default=REPO_ROOT / "benchmarks/results/layer_ops.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.decode_tokens, args.concurrency, args.batch_tokens, args.repeats = 8, 2, 4, 1
        args.prompt_len, args.group_size = 16, 64

    import torch

    from tandem.cpu import cpu_flags

    float_dir, int4_dir = build_checkpoints(args)
    common: dict[str, Any] = {"max_num_seqs": args.concurrency, "num_kv_blocks": 64 + 8 * args.concurrency}
    variants = {
        "int8": (float_dir, dict(common, quantization="int8")),
        "int4+int8": (int4_dir, dict(common, quantization="int8")),
        "bfloat16": (float_dir, dict(common, dtype="bfloat16")),
    }
    loaded = [Toggled(name, *variants[name], args) for name in args.variants.split(",")]
    for i in range(args.repeats):
        for v in loaded:  # on and off in alternating order, so neither always runs first
            for fused in ((True, False) if i % 2 == 0 else (False, True)):
                v.round(fused)
    results = [v.toggled_result() for v in loaded]
    c = args.concurrency
    for r in results:
        print(f"{r['variant']:9s} c=1 decode {r['torch_c1_decode_tok_s']:6.2f} -> {r['kernels_c1_decode_tok_s']:6.2f} "
              f"tok/s ({r['c1_ratio']:.2f}x)   c={c} output {r[f'torch_c{c}_output_tok_s']:7.2f} -> "
              f"{r[f'kernels_c{c}_output_tok_s']:7.2f} tok/s ({r[f'c{c}_ratio']:.2f}x)", flush=True)
    out = {
        "command": "python benchmarks/layer_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": sorted({"avx2", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_flags()),
                    "torch_threads": torch.get_num_threads()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
    }
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
