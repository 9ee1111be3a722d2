#!/usr/bin/env python
"""Time a gated MLP's gate/up product with SiLU-and-multiply in its epilogue against the product
followed by `silu_mul`, on a whole model's gate/up weights (AMX tile kernels, bfloat16 and int8;
bfloat16 column panels on CPUs with AVX512-BF16).

Each of `--layers` layers has its own weight (the 415M peer checkpoint's 896 -> 2 x 4864), in
transparent huge pages as the loader places them, cycled through in order, so a pass reads the
weights from memory as a decode step does. Paths run interleaved, best of `--reps` passes each:

- bf16 separate: `gemm_amx_bf16` (the [M, 2I] product) then `silu_mul`
- bf16 fused: `gemm_amx_bf16_silu_mul` on the interleaved tiles (tandem/model/gate_up.py)
- bf16 oneDNN separate: oneDNN's packed GEMM then `silu_mul` (what prompt-sized rows take)
- int8 separate / int8 fused: `Int8Linear` then `silu_mul`, and `gemm_amx_w8a8_silu_mul` on its
  interleaved tiles
- bf16 panels separate / bf16 panels fused (where `gemm_bf16_panels_silu_mul` built, AMX or not):
  `gemm_bf16_panels` then `silu_mul`, and the fused op on the interleaved panels
- int8 panels separate / int8 panels fused (without AMX, where `gemm_w8a8_panels_silu_mul` built):
  `Int8Linear` on its panels then `silu_mul`, and the layer's `silu_mul` after `fuse_silu`

Without AMX only the panel paths run.

    python benchmarks/gate_up_silu.py --rows 1,8,32,64,128,256,512 --threads 2 \
        --json benchmarks/results/gate_up_silu.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE = 896, 4864


Paths = dict[str, tuple[str, Callable[[torch.Tensor], object]]]


def build(layers: int, amx: bool, panels: bool) -> Paths:
    """path name -> (activation dtype, fn(x) running every layer once)."""
    from tandem.model.huge_pages import huge_pages_available, to_huge_pages

    place = to_huge_pages if huge_pages_available() else (lambda t: t)
    weights = [torch.randn(2 * INTERMEDIATE, HIDDEN) * 0.02 for _ in range(layers)]
    bf16 = [w.to(torch.bfloat16) for w in weights]
    paths: Paths = build_amx(weights, bf16, place) if amx else {}
    if panels:
        paths.update(build_panels(weights, bf16, place))
    return paths


def build_panels(
    weights: list[torch.Tensor], bf16: list[torch.Tensor], place: Callable[[torch.Tensor], torch.Tensor]
) -> Paths:
    from tandem import kernels
    from tandem.model.gate_up import interleave_panels
    from tandem.model.panels import pack_panels
    from tandem.model.quant import Int8Linear

    ops = torch.ops.tandem
    n = 2 * INTERMEDIATE
    separate = [place(pack_panels(w)) for w in bf16]
    fused = [place(interleave_panels(pack_panels(w), INTERMEDIATE)) for w in bf16]
    paths: Paths = {
        "bf16 panels separate": ("bf16", lambda x: [ops.silu_mul(ops.gemm_bf16_panels(x, p, n, None)) for p in separate]),
        "bf16 panels fused": ("bf16", lambda x: [ops.gemm_bf16_panels_silu_mul(x, p, INTERMEDIATE) for p in fused]),
    }
    if kernels.has("gemm_w8a8_panels_silu_mul"):
        int8 = [Int8Linear(w, None) for w in weights]
        int8_fused = [Int8Linear(w, None) for w in weights]
        if not all(q.panels is not None and q.fuse_silu(INTERMEDIATE) for q in int8_fused):
            raise SystemExit("int8 layers did not take the fused panel layout")
        for q in int8 + int8_fused:
            q.panels = place(q.panels)
            q.bind_tensors()
        paths["int8 panels separate"] = ("bf16", lambda x: [ops.silu_mul(q(x)) for q in int8])
        paths["int8 panels fused"] = ("bf16", lambda x: [q.silu_mul(x) for q in int8_fused])
    return paths


def build_amx(
    weights: list[torch.Tensor], bf16: list[torch.Tensor], place: Callable[[torch.Tensor], torch.Tensor]
) -> Paths:
    from tandem.model.gate_up import interleave_tiles
    from tandem.model.quant import Int8Linear

    ops = torch.ops.tandem
    tiles = [place(ops.amx_pack(w)) for w in bf16]
    fused_tiles = [place(interleave_tiles(ops.amx_pack(w), INTERMEDIATE)) for w in bf16]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in bf16]
    int8 = [Int8Linear(w, None) for w in weights]
    int8_fused = [Int8Linear(w, None) for w in weights]
    for q in int8 + int8_fused:
        q.tiles = place(q.tiles)
    if not all(q.fuse_silu(INTERMEDIATE) for q in int8_fused):
        raise SystemExit("int8 layers did not take the fused layout")
    n = 2 * INTERMEDIATE

    def int8_fused_op(x: torch.Tensor, q: Int8Linear) -> torch.Tensor:
        # The op itself at every row count (the layer's silu_mul stops fusing past 64 rows).
        scale, row_sum, bias = q._tile_columns
        return ops.gemm_amx_w8a8_silu_mul(x, q.tiles, INTERMEDIATE, scale, row_sum, bias)

    return {
        "bf16 separate": ("bf16", lambda x: [ops.silu_mul(ops.gemm_amx_bf16(x, t, n, None)) for t in tiles]),
        "bf16 fused": ("bf16", lambda x: [ops.gemm_amx_bf16_silu_mul(x, t, INTERMEDIATE) for t in fused_tiles]),
        "bf16 oneDNN separate": (
            "bf16",
            lambda x: [ops.silu_mul(torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")) for p in onednn],
        ),
        "int8 separate": ("bf16", lambda x: [ops.silu_mul(q(x)) for q in int8]),
        "int8 fused": ("bf16", lambda x: [int8_fused_op(x, q) for q in int8_fused]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64,128,256,512")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from tandem import kernels

    kernels.load()
    amx = kernels.has("gemm_amx_bf16_silu_mul") and bool(torch.ops.tandem.amx_ready())
    panels = kernels.has("gemm_bf16_panels_silu_mul")
    if not (amx or panels):
        raise SystemExit("needs AMX (Tandem's tile kernels) or AVX512-BF16 (its column panels)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    paths = build(args.layers, amx, panels)
    pairs = [(kind, f"{kind} fused", f"{kind} separate") for kind in ("bf16", "int8", "bf16 panels", "int8 panels")]
    pairs = [p for p in pairs if p[1] in paths]
    results = []
    print(f"{args.layers} gate/up layers {HIDDEN} -> 2 x {INTERMEDIATE}, threads {torch.get_num_threads()}")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        best = {name: float("inf") for name in paths}
        with torch.inference_mode():
            for _, fn in paths.values():
                fn(x)  # warm-up: oneDNN primitives, page faults
            for _ in range(args.reps):
                for name, (_, fn) in paths.items():
                    t0 = time.perf_counter()
                    fn(x)
                    best[name] = min(best[name], time.perf_counter() - t0)
        row = {"rows": rows, **{f"{name} ms": t * 1e3 for name, t in best.items()}}
        for kind, fused, separate in pairs:
            row[f"{kind} fused / separate"] = best[fused] / best[separate]
        results.append(row)
        ratios = " ".join(f"{kind} {row[f'{kind} fused / separate']:.2f}" for kind, _, _ in pairs)
        print(f"rows {rows:4d}  " + "  ".join(f"{name} {t * 1e3:6.2f}" for name, t in best.items())
              + f"  ms | fused/separate {ratios}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
