#!/usr/bin/env python
"""Time the CPU GEMM paths a linear layer can take, per batch size, on a model's real shapes.

Each layer's weights are distinct tensors (a whole model's worth), cycled through in order, so the
figures include reading the weights from memory as a decode step does, not from cache.

    python benchmarks/gemm_paths.py --rows 1,8,32,128 --json results/gemm_paths.json

`--only PREFIX` keeps the paths whose name starts with it (`--only int4`: the 4-bit products; with
`--few-rows`, the kernel pairs: `--only int8`).

`--per-shape ROWS` instead times each layer shape alone at prompt-sized row counts (bound by
compute, not by reading weights), bfloat16 on AMX: Tandem's tile kernel against oneDNN's packed
GEMM, interleaved, in TFLOP/s (what a layer holding one copy of its weight gives up, per shape).

    python benchmarks/gemm_paths.py --per-shape 128,256,512,1024 --json results/gemm_shapes.json

`--few-rows ROWS` times each of Tandem's few-row kernels alone (`gemv_f32`, `gemm_bf16_panels` or
`gemv_bf16`, `gemm_w8a8`, `gemm_w8_f32`, wherever this CPU built them) against the library path it
stands in for (oneDNN's
reordered float32 / bfloat16 product; oneDNN's int8 GEMM on rows quantized by Tandem, or without
VNNI the weight-only int8 kernel; that one against the int8 weight widened to float per call), interleaved
pairs over a whole model's layers, median time: the A/B behind each kernel's row limit; rows
`bf16 panels/rows`, `int8 panels/rows` and `int4 panels/rows` time the panel kernels against
`gemv_bf16`, `gemm_w8a8` and `gemm_int4` over the row-layout weight they replaced
(`tandem.model.linear.kernel_max_rows`), printed beside it (on AMX hosts the tile kernels take
bfloat16 and int8 layers instead; the limits there serve layers without tiles), with the streaming read bandwidth of
the machine (a 2-thread sum over 512 MiB) that the one-row figures are a fraction of. Row counts
above 16 are timed only for the panels that take every product of their layers, against the
library's GEMM up to prompt sizes: `gemm_w8a8_panels` where it built, and `gemm_bf16_panels` on
CPUs with AVX512-BF16 and no AMX (`tandem.model.linear.bf16_panels_every_row_count`).
`TANDEM_CPU_MARCH=cooperlake` on an AMX host makes both sides take their non-AMX paths (Tandem's
kernels and choices, and oneDNN and MKL capped at that kind's instructions: an AMD EPYC's
products; the timings are the host's).

    python benchmarks/gemm_paths.py --few-rows 1,2,4,6,8,12,16 --json results/gemm_few_rows.json

`--huge-pages ROWS` times Tandem's AMX tile kernels (bfloat16 and int8) over a whole model's layers
with the tiles in ordinary 4 KB pages and in transparent huge pages (tandem/model/huge_pages.py),
interleaved, best of `--reps` passes each (what the loader's move to huge pages is worth).

    python benchmarks/gemm_paths.py --huge-pages 1,8,32,64 --json results/gemm_huge_pages.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# (in, out) of one decoder layer of the 415M peer checkpoint: qkv, o, gate_up, down.
LAYER_SHAPES = [(896, 1152), (896, 896), (896, 9728), (4864, 896)]
# Rows the few-row kernels take (`--few-rows` times more only where a kernel takes every row count).
FEW_ROWS = 16


def make_paths(weights: list[torch.Tensor], rows: int) -> dict[str, tuple[list, Callable]]:
    """name -> (per-layer prepared weights, fn(x, prepared) -> y)."""
    from tandem import kernels
    from tandem.model.linear import PackedLinear, onednn_available
    from tandem.model.quant import Int8Linear, cpu_has_vnni, dynamic_int8_available, onednn_int8_available

    paths: dict[str, tuple[list, Callable]] = {}
    paths["fp32 F.linear (MKL)"] = (weights, lambda x, w: F.linear(x, w))
    if rows <= 16 and kernels.has("gemv_f32"):  # Tandem's few-row kernel alone (AVX-512 or AVX2)
        paths["fp32 Tandem kernel gemv_f32"] = (weights, lambda x, w: torch.ops.tandem.gemv_f32(x, w, None))
    bf16 = [w.to(torch.bfloat16) for w in weights]
    if onednn_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        paths["fp32 oneDNN reordered"] = (
            packed,
            lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        )
        paths["fp32 Tandem PackedLinear"] = ([PackedLinear(w, None) for w in weights], lambda x, m: m(x))
    paths["bf16 F.linear"] = (bf16, lambda x, w: F.linear(x.to(torch.bfloat16), w))
    if onednn_available(torch.bfloat16):
        packed16 = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in bf16]
        paths["bf16 oneDNN reordered"] = (
            packed16,
            lambda x, p: torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), p, None, "none", [], ""),
        )
        if kernels.has("gemm_amx_bf16") and torch.ops.tandem.amx_ready():  # AMX tiles, Tandem's layout
            tiles = [(torch.ops.tandem.amx_pack(w), w.shape[0]) for w in bf16]
            paths["bf16 Tandem AMX kernel gemm_amx_bf16"] = (
                tiles,
                lambda x, t: torch.ops.tandem.gemm_amx_bf16(x.to(torch.bfloat16), t[0], t[1], None),
            )
        # Tandem's own kernels where they built (tandem/kernels), oneDNN above.
        paths["bf16 Tandem PackedLinear"] = (
            [PackedLinear(w, None) for w in bf16],
            lambda x, m: m(x.to(torch.bfloat16)),
        )
    int8 = [Int8Linear(w, None) for w in weights]
    for m in int8:  # the paths below read the [out, in] weight, which a layer holding panels rebuilds
        if m.qweight is None:
            m.qweight = m.int8_weight()
    if cpu_has_vnni() and onednn_int8_available() and kernels.has("quantize_rows_u8"):
        # oneDNN's int8 GEMM on its own prepacked copy (what Int8Linear runs without AMX).
        qlinear = [
            (torch.ops.onednn.qlinear_prepack(m.qweight, None), m.scale, torch.zeros(m.out_features, dtype=torch.long))
            for m in int8
        ]
        paths["int8 oneDNN qlinear (W8A8, per-row scales)"] = (
            qlinear,
            lambda x, q: torch.ops.onednn.qlinear_pointwise(
                *torch.ops.tandem.quantize_rows_u8(x)[:1], 1.0, 128, q[0], q[1], q[2], None,
                1.0, 0, torch.float32, "none", [], "",
            ),
        )
    if dynamic_int8_available() and cpu_has_vnni():
        dynamic = [m._prepack() for m in int8]
        paths["int8 PyTorch linear_dynamic (W8A8, one scale per tensor)"] = (
            dynamic,
            lambda x, p: torch.ops.quantized.linear_dynamic(x, p, False),
        )
    if kernels.has("gemm_amx_w8a8") and torch.ops.tandem.amx_ready():
        tiles8 = [(torch.ops.tandem.amx_pack(m.qweight), m) for m in int8]
        paths["int8 Tandem AMX kernel gemm_amx_w8a8"] = (
            tiles8,
            lambda x, t: torch.ops.tandem.gemm_amx_w8a8(x, t[0], t[1].out_features, t[1].scale, t[1].row_sum, None),
        )
    # Tandem's kernels where they built, oneDNN's int8 GEMM above.
    paths["int8 Tandem Int8Linear (W8A8)"] = (int8, lambda x, m: m(x))
    if rows <= 8 and hasattr(torch.ops.aten, "_weight_int8pack_mm"):  # far too slow beyond
        paths["int8 weight-only ATen kernel"] = (
            int8,
            lambda x, m: torch.ops.aten._weight_int8pack_mm(x, m.qweight, m.scale),
        )
    if rows <= 16 and kernels.has("gemm_w8_f32"):  # no VNNI: int8 weights widened in registers
        paths["int8 weight-only Tandem kernel gemm_w8_f32"] = (
            int8,
            lambda x, m: torch.ops.tandem.gemm_w8_f32(x, m.qweight, m.scale, None),
        )
    paths["int8 weight-only, widen + fp32 GEMM"] = (
        int8,
        lambda x, m: F.linear(x, m.qweight.to(x.dtype)) * m.scale,
    )
    paths.update(int4_paths(weights, rows))
    return paths


def int4_paths(weights: list[torch.Tensor], rows: int) -> dict[str, tuple[list, Callable]]:
    """4-bit layers (groups of 32, with zero points) of the same shapes, bfloat16 activations as the
    engine runs them on a bfloat16 CPU: each product a 4-bit layer can take (tandem/model/int4.py).
    Each layer is prepared in both layouts: the row layout the row kernels read and, where the panel
    kernel is built (AVX512-VNNI), the column panels."""
    from types import SimpleNamespace

    from tandem import kernels
    from tandem.model.int4 import DequantScratch, pack_nibbles
    from tandem.model.panels import pack_group_panels, pack_int4_panels

    g = torch.Generator().manual_seed(0)
    panels = kernels.has("gemm_int4_panels")
    layers = []
    for w in weights:
        n, k = w.shape
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        s = torch.rand(n, k // 32, generator=g) * 0.01
        zs = s * 7.5
        layers.append(SimpleNamespace(
            qweight=pack_nibbles(q), scales=s, zs=zs, n=n, k=k,
            panels=pack_int4_panels(q) if panels else None,
            panel_scales=pack_group_panels(s) if panels else None,
            panel_zs=pack_group_panels(zs) if panels else None,
        ))
    paths: dict[str, tuple[list, Callable]] = {}
    bf16 = torch.bfloat16
    scratch = DequantScratch()  # one buffer for every layer, as a model's 4-bit layers share one

    def dequantized(m: SimpleNamespace) -> torch.Tensor:
        out = scratch.get(bf16, m.n * m.k).view(m.n, m.k)
        return torch.ops.tandem.dequant_int4(m.qweight, m.scales, m.zs, 32, out)

    if rows <= 64 and kernels.has("gemm_int4"):  # linear in rows: far too slow beyond
        paths["int4 Tandem kernel gemm_int4 (bf16 x)"] = (
            layers,
            lambda x, m: torch.ops.tandem.gemm_int4(x.to(bf16), m.qweight, m.scales, m.zs, 32, None),
        )
    if panels:
        paths["int4 Tandem panels gemm_int4_panels (bf16 x)"] = (
            layers,
            lambda x, m: torch.ops.tandem.gemm_int4_panels(
                x.to(bf16), m.panels, m.n, m.panel_scales, m.panel_zs, 32, None
            ),
        )
    if kernels.has("gemm_amx_int4") and torch.ops.tandem.amx_ready():
        paths["int4 Tandem AMX kernel gemm_amx_int4"] = (
            layers,
            lambda x, m: torch.ops.tandem.gemm_amx_int4(x.to(bf16), m.qweight, m.scales, m.zs, 32, None),
        )
    paths["int4 dequantize per call + bf16 GEMM"] = (
        layers,
        lambda x, m: F.linear(x.to(bf16), dequantized(m)),
    )
    return paths


def time_path(prepared: list, fn: Callable, x_by_in: dict[int, torch.Tensor], reps: int) -> float:
    def one_pass() -> None:
        for p, w in zip(prepared, _shapes):
            fn(x_by_in[w[0]], p)

    one_pass()
    t0 = time.perf_counter()
    for _ in range(reps):
        one_pass()
    return (time.perf_counter() - t0) / reps


_shapes: list[tuple[int, int]] = []


SHAPE_NAMES = ["qkv", "o", "gate_up", "down"]


def read_bandwidth(reps: int = 10) -> float:
    """Bytes a second a plain streaming read reaches on this machine with torch's threads (a sum
    over 512 MiB of float32, best of `reps`)."""
    x = torch.ones(512 * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


# The CPU kind a run reports, by its best instruction-set flag.
KINDS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def few_row_pairs(weights: list[torch.Tensor]) -> dict[str, tuple[Callable, Callable, int]]:
    """dtype name -> (Tandem's kernel fn(x, i), the library's fn(x, i), weight bytes a pass) for
    every few-row kernel this CPU built; i indexes `weights`."""
    from tandem import kernels
    from tandem.model.linear import onednn_available
    from tandem.model.panels import pack_panels
    from tandem.model.quant import Int8Linear, cpu_has_vnni, onednn_int8_available

    pairs: dict[str, tuple[Callable, Callable, int]] = {}
    f32_bytes = sum(w.numel() for w in weights) * 4

    def onednn(ws: list[torch.Tensor], dtype: torch.dtype) -> Callable:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
        return lambda x, i: torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed[i], None, "none", [], "")

    if kernels.has("gemv_f32") and onednn_available(torch.float32):
        pairs["float32"] = (lambda x, i: torch.ops.tandem.gemv_f32(x, weights[i], None), onednn(weights, torch.float32), f32_bytes)
    if kernels.has("gemv_bf16") and onednn_available(torch.bfloat16):
        bf16 = [w.to(torch.bfloat16) for w in weights]
        rows_kernel = lambda x, i: torch.ops.tandem.gemv_bf16(x.to(torch.bfloat16), bf16[i], None)
        if kernels.has("gemm_bf16_panels"):  # what a layer runs without AMX, against oneDNN and gemv_bf16
            panels = [pack_panels(w) for w in bf16]

            def panel_kernel(x: torch.Tensor, i: int) -> torch.Tensor:
                return torch.ops.tandem.gemm_bf16_panels(x.to(torch.bfloat16), panels[i], bf16[i].shape[0], None)

            pairs["bfloat16"] = (panel_kernel, onednn(bf16, torch.bfloat16), f32_bytes // 2)
            pairs["bf16 panels/rows"] = (panel_kernel, rows_kernel, f32_bytes // 2)
        else:
            pairs["bfloat16"] = (rows_kernel, onednn(bf16, torch.bfloat16), f32_bytes // 2)
    if kernels.has("gemm_w8a8") and cpu_has_vnni() and onednn_int8_available():
        int8 = [Int8Linear(w, None) for w in weights]
        rows8 = [m.int8_weight() for m in int8]
        q = [torch.ops.onednn.qlinear_prepack(w8, None) for w8 in rows8]
        zero = [torch.zeros(m.out_features, dtype=torch.long) for m in int8]

        def qlinear(x: torch.Tensor, i: int) -> torch.Tensor:
            xq, x_scale = torch.ops.tandem.quantize_rows_u8(x)
            y = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, q[i], int8[i].scale, zero[i], None, 1.0, 0, torch.float32, "none", [], ""
            )
            return y.mul_(x_scale[:, None])

        def row_kernel(x: torch.Tensor, i: int) -> torch.Tensor:
            return torch.ops.tandem.gemm_w8a8(x, rows8[i], int8[i].scale, int8[i].row_sum, None)

        if kernels.has("gemm_w8a8_panels"):  # what a layer runs without AMX, against oneDNN and gemm_w8a8
            panels8 = [pack_panels(w8) for w8 in rows8]

            def panel_kernel8(x: torch.Tensor, i: int) -> torch.Tensor:
                m = int8[i]
                return torch.ops.tandem.gemm_w8a8_panels(x, panels8[i], m.out_features, m.scale, m.row_sum, None)

            pairs["int8"] = (panel_kernel8, qlinear, f32_bytes // 4)
            pairs["int8 panels/rows"] = (panel_kernel8, row_kernel, f32_bytes // 4)
        else:
            pairs["int8"] = (row_kernel, qlinear, f32_bytes // 4)
    if kernels.has("gemm_w8_f32"):  # no VNNI: int8 weights widened in registers, against widened per call
        w8 = [Int8Linear(w, None) for w in weights]

        def weight_only(x: torch.Tensor, i: int) -> torch.Tensor:
            return torch.ops.tandem.gemm_w8_f32(x, w8[i].qweight, w8[i].scale, None)

        if kernels.has("gemm_w8a8"):  # AVX2 W8A8 against the weight-only kernel it stands in for
            pairs["int8"] = (
                lambda x, i: torch.ops.tandem.gemm_w8a8(x, w8[i].qweight, w8[i].scale, w8[i].row_sum, None),
                weight_only,
                f32_bytes // 4,
            )
        pairs["int8 weight-only"] = (
            weight_only,
            lambda x, i: F.linear(x, w8[i].qweight.to(x.dtype)) * w8[i].scale,
            f32_bytes // 4,
        )
    if kernels.has("gemm_int4_panels") and kernels.has("gemm_int4"):
        # 4-bit, symmetric groups of 128 (the GPTQ checkpoint of benchmarks/int4.py): the panels
        # against the row kernel, bfloat16 activations.
        from tandem.model.int4 import pack_nibbles
        from tandem.model.panels import pack_group_panels, pack_int4_panels

        g = torch.Generator().manual_seed(0)
        q4 = [torch.randint(0, 16, tuple(w.shape), generator=g, dtype=torch.uint8) for w in weights]
        s4 = [torch.rand(w.shape[0], w.shape[1] // 128, generator=g) * 0.01 for w in weights]
        rows4 = [pack_nibbles(q) for q in q4]
        panels4 = [(pack_int4_panels(q), pack_group_panels(s)) for q, s in zip(q4, s4)]

        def panel_kernel4(x: torch.Tensor, i: int) -> torch.Tensor:
            p, ps = panels4[i]
            return torch.ops.tandem.gemm_int4_panels(x.to(torch.bfloat16), p, weights[i].shape[0], ps, None, 128, None)

        def row_kernel4(x: torch.Tensor, i: int) -> torch.Tensor:
            return torch.ops.tandem.gemm_int4(x.to(torch.bfloat16), rows4[i], s4[i], None, 128, None)

        pairs["int4 panels/rows"] = (panel_kernel4, row_kernel4, f32_bytes // 8 + f32_bytes // 128)
    return pairs


def _timed_pass(fn: Callable, shapes: list[tuple[int, int]], xs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for i, (k, _) in enumerate(shapes):
        fn(xs[k], i)
    return time.perf_counter() - t0


def few_rows(rows_list: list[int], layers: int, reps: int, only: str = "") -> dict:
    """Each few-row kernel against its library path per row count (median of `reps` interleaved
    pairs of passes over `layers` layers), with the row limit Tandem uses on this CPU; `only`: the
    pairs whose name starts with it."""
    import os
    import statistics

    from tandem import kernels
    from tandem.cpu import LIBRARY_ISA, MARCH_ENV, cpu_flags
    from tandem.model.linear import bf16_panels_every_row_count, kernel_max_rows, mkl_max_rows
    from tandem.model.quant import W8_KERNEL_MAX_ROWS, w8a8_kernel_max_rows

    kernels.load()
    shapes = LAYER_SHAPES * layers
    weights = [torch.randn(o, i) * 0.02 for i, o in shapes]
    # Pairs whose kernel takes every row count (no limit), timed past FEW_ROWS against the library's GEMM.
    every_row_count = {"int8"} if kernels.has("gemm_w8a8_panels") else set()
    if kernels.has("gemm_bf16_panels") and bf16_panels_every_row_count():
        every_row_count.add("bfloat16")
    limits = {
        "float32": kernel_max_rows(torch.float32),
        "bfloat16": None if "bfloat16" in every_row_count else kernel_max_rows(torch.bfloat16),
        "bf16 panels/rows": kernel_max_rows(torch.bfloat16),
        "int8": None if "int8" in every_row_count else w8a8_kernel_max_rows(),
        "int8 panels/rows": None,
        "int8 weight-only": W8_KERNEL_MAX_ROWS,
        "int4 panels/rows": None,  # the panels take every row count
    }
    bandwidth = read_bandwidth()
    flags = cpu_flags()  # under TANDEM_CPU_MARCH, also caps the libraries (before any product here)
    env = {k: os.environ[k] for k in (MARCH_ENV, *LIBRARY_ISA) if k in os.environ}
    kind = next((name for flag, name in KINDS if flag in flags), "no AVX2")
    print(f"{len(weights)} matrices, read bandwidth {bandwidth / 1e9:.1f} GB/s, threads {torch.get_num_threads()}, "
          f"kernels for: {kind}{' ' + str(env) if env else ''}")
    out = []
    for dtype, (kernel, library, nbytes) in few_row_pairs(weights).items():
        if not dtype.startswith(only):
            continue
        for rows in rows_list:
            if rows > FEW_ROWS and dtype not in every_row_count:
                continue  # only the panels that take every row count (against the library's GEMM)
            xs = {i: torch.randn(rows, i) for i, _ in LAYER_SHAPES}

            with torch.inference_mode():
                _timed_pass(kernel, shapes, xs), _timed_pass(library, shapes, xs)
                pairs = [(_timed_pass(kernel, shapes, xs), _timed_pass(library, shapes, xs)) for _ in range(reps)]
            tk = statistics.median(p[0] for p in pairs)
            tl = statistics.median(p[1] for p in pairs)
            row = {
                "dtype": dtype, "rows": rows, "kernel_ms": tk * 1e3, "library_ms": tl * 1e3,
                "kernel_over_library_time": tk / tl, "kernel_gbps": nbytes / tk / 1e9,
                "kernel_fraction_of_read": nbytes / tk / bandwidth, "limit": limits[dtype],
            }
            out.append(row)
            limit = limits[dtype]
            mark = "kernel" if limit is None or rows <= limit else "library"
            if dtype == "float32" and rows <= mkl_max_rows(torch.float32):
                mark = "MKL sgemv"
            print(f"{dtype:16s} rows {rows:3d}  kernel {row['kernel_ms']:6.1f} ms ({row['kernel_gbps']:4.1f} GB/s, "
                  f"{row['kernel_fraction_of_read']:4.0%} of read)  library {row['library_ms']:6.1f} ms  "
                  f"time ratio {row['kernel_over_library_time']:.2f}  (limit {limit or 'none'}: {mark})")
    return {"read_gbps": bandwidth / 1e9, "cpu_kind": kind, "env": env, "few_rows": out}


def per_shape(rows_list: list[int], reps: int) -> list[dict]:
    """bfloat16 tile kernel vs oneDNN per layer shape (median of `reps` interleaved pairs)."""
    import statistics

    from tandem.model.linear import PackedLinear, amx_tiles_available

    if not amx_tiles_available():
        raise SystemExit("--per-shape needs AMX (the tile kernel)")
    out = []
    for rows in rows_list:
        for (k, n), name in zip(LAYER_SHAPES, SHAPE_NAMES):
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            layer = PackedLinear(w, None)  # the tiles as the model lays them out
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)  # oneDNN's copy, whatever the layer keeps
            x = torch.randn(rows, k).to(torch.bfloat16)
            tiles = lambda: torch.ops.tandem.gemm_amx_bf16(x, layer.tiles, n, None)  # noqa: B023
            onednn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: B023
            times: dict[str, list[float]] = {"tiles": [], "onednn": []}
            with torch.inference_mode():
                for f in (tiles, onednn, tiles, onednn):
                    f()
                for _ in range(reps):
                    for key, f in (("tiles", tiles), ("onednn", onednn)):
                        t0 = time.perf_counter()
                        f()
                        times[key].append(time.perf_counter() - t0)
            flops = 2 * rows * k * n
            row = {"rows": rows, "shape": name, "in": k, "out": n}
            for key, ts in times.items():
                row[f"{key}_tflops"] = flops / statistics.median(ts) / 1e12
            row["tiles_over_onednn_time"] = row["onednn_tflops"] / row["tiles_tflops"]
            out.append(row)
            print(f"rows {rows:5d}  {name:8s} tiles {row['tiles_tflops']:5.2f} TFLOP/s  oneDNN "
                  f"{row['onednn_tflops']:5.2f} TFLOP/s  tiles' time / oneDNN's {row['tiles_over_onednn_time']:.2f}")
    return out


def page_sizes(rows_list: list[int], layers: int, reps: int) -> list[dict]:
    """AMX tile kernels over `layers` layers' weights in 4 KB pages and in huge pages."""
    from tandem import kernels
    from tandem.model.huge_pages import huge_pages_available, to_huge_pages
    from tandem.model.quant import Int8Linear

    if not (kernels.has("gemm_amx_bf16") and torch.ops.tandem.amx_ready()):
        raise SystemExit("--huge-pages needs AMX (the tile kernels)")
    if not huge_pages_available():
        raise SystemExit("--huge-pages: this kernel hands out no transparent huge pages")
    shapes = LAYER_SHAPES * layers
    bf16, int8 = [], []
    for k, n in shapes:
        w = torch.randn(n, k) * 0.02
        bf16.append((torch.ops.tandem.amx_pack(w.to(torch.bfloat16)), n, k))
        q = Int8Linear(w, None)
        int8.append((torch.ops.tandem.amx_pack(q.qweight), q, k))
    weights = {
        "bf16": {"4k": bf16, "huge": [(to_huge_pages(t), n, k) for t, n, k in bf16]},
        "int8": {"4k": int8, "huge": [(to_huge_pages(t), q, k) for t, q, k in int8]},
    }
    nbytes = {dtype: sum(t.numel() * t.element_size() for t, _, _ in w["4k"]) for dtype, w in weights.items()}

    def one_pass(dtype: str, layers_: list, xs: dict[int, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for t, meta, k in layers_:
            if dtype == "bf16":
                torch.ops.tandem.gemm_amx_bf16(xs[k], t, meta, None)
            else:
                torch.ops.tandem.gemm_amx_w8a8(xs[k], t, meta.out_features, meta.scale, meta.row_sum, None)
        return time.perf_counter() - t0

    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k, _ in LAYER_SHAPES}
        for dtype, by_pages in weights.items():
            best = {pages: float("inf") for pages in by_pages}
            with torch.inference_mode():
                for _ in range(reps):
                    for pages, layers_ in by_pages.items():
                        best[pages] = min(best[pages], one_pass(dtype, layers_, xs))
            row = {"rows": rows, "dtype": dtype, "bytes": nbytes[dtype]}
            for pages, t in best.items():
                row[f"{pages}_ms"] = t * 1e3
                row[f"{pages}_gbps"] = nbytes[dtype] / t / 1e9
            row["huge_over_4k_time"] = best["huge"] / best["4k"]
            out.append(row)
            print(f"rows {rows:3d} {dtype}  4 KB pages {row['4k_ms']:6.1f} ms ({row['4k_gbps']:4.1f} GB/s)  "
                  f"huge pages {row['huge_ms']:6.1f} ms ({row['huge_gbps']:4.1f} GB/s)  "
                  f"time ratio {row['huge_over_4k_time']:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--per-shape", default=None, metavar="ROWS", help="bf16 tiles vs oneDNN per layer shape")
    ap.add_argument("--huge-pages", default=None, metavar="ROWS", help="tile kernels: 4 KB vs huge pages")
    ap.add_argument("--few-rows", default=None, metavar="ROWS", help="few-row kernels vs the library, per row count")
    ap.add_argument("--only", default="", metavar="PREFIX", help="time only the paths named PREFIX...")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.huge_pages:
        rows = page_sizes([int(r) for r in args.huge_pages.split(",")], args.layers, max(args.reps, 7))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "huge_pages": rows}, indent=2))
        return
    if args.few_rows:
        report = few_rows([int(r) for r in args.few_rows.split(",")], args.layers, max(args.reps, 7), args.only)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"threads": torch.get_num_threads(), **report}, indent=2))
        return
    if args.per_shape:
        shapes = per_shape([int(r) for r in args.per_shape.split(",")], max(args.reps, 15))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "per_shape": shapes}, indent=2))
        return
    _shapes[:] = LAYER_SHAPES * args.layers
    weights = [torch.randn(o, i) * 0.02 for i, o in _shapes]
    total_bytes = sum(w.numel() for w in weights) * 4
    flops_per_row = 2 * sum(w.numel() for w in weights)
    results = []
    print(f"{len(weights)} matrices, {total_bytes / 1e9:.2f} GB fp32, threads {torch.get_num_threads()}")
    for rows in [int(r) for r in args.rows.split(",")]:
        x_by_in = {i: torch.randn(rows, i) for i, _ in LAYER_SHAPES}
        for name, (prepared, fn) in make_paths(weights, rows).items():
            if not name.startswith(args.only):
                continue
            with torch.inference_mode():
                t = time_path(prepared, fn, x_by_in, args.reps)
            gflops = flops_per_row * rows / t / 1e9
            results.append({"rows": rows, "path": name, "seconds": t, "gflops": gflops})
            print(f"rows {rows:4d}  {name:28s} {t * 1e3:8.1f} ms  {gflops:6.1f} GFLOP/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
