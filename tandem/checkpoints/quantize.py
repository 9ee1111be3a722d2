"""Write a float Llama-family checkpoint in the published quantized formats (tests, benchmarks).

Round-to-nearest quantization of every decoder projection (q/k/v/o, gate/up/down; the LM head and
embeddings stay float, as AutoAWQ and GPTQ leave them by default), written in exactly the layout
each tool publishes (tandem/model/int4_formats.py describes them): AutoAWQ GEMM (`awq`),
AutoGPTQ/GPTQModel (`gptq`, v1 or v2 zeros), compressed-tensors `pack-quantized` int4 and
`float-quantized` FP8, and `fp8` (block `weight_scale_inv`, or one `weight_scale` per tensor).

With `reference=FOLDER` the same model is also written as a float32 checkpoint whose weights are
the quantized values dequantized here, from the integers and scales before packing: the readers'
results are checked against it without sharing any of their code.

    python -m tandem.checkpoints.quantize SRC DST --method awq --group-size 128
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tandem.model.int4_formats import AWQ_PACK_ORDER

METHODS = ("awq", "gptq", "ct-int4", "ct-fp8", "fp8")
_PROJ = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
FP8_MAX = 448.0


@dataclass(frozen=True)
class Scheme:
    method: str  # one of METHODS
    group_size: int = 128  # int4: inputs per scale; -1: one group per output channel
    sym: bool = False  # int4: no zero points (the midpoint 8); gptq and ct-int4 only
    gptq_format: str = "gptq"  # "gptq" (v1: zeros stored minus one) or "gptq_v2"
    # fp8: the [out, in] block per weight_scale_inv, None for one scale per tensor;
    # ct-fp8: None for one scale per output channel.
    fp8_block: tuple[int, int] | None = (128, 128)
    scale_dtype: torch.dtype = torch.float16
    # gptq, ct-int4: act-order, groups of inputs taken in a permuted order (the permutation depends
    # on in_features only, so projections that share an input, fused in Tandem, share it as GPTQ's do).
    desc_act: bool = False


def act_order(in_features: int) -> torch.Tensor:
    """The input order act-order groups follow (GPTQ sorts by activation size; any order will do)."""
    return torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features))


def _grouped(w: torch.Tensor, s: Scheme, zero_range: tuple[int, int] = (0, 15)
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scales, zeros, dequantized weight, g_idx or None), q and the weight in input order."""
    in_f = w.shape[1]
    perm = act_order(in_f) if s.desc_act else torch.arange(in_f)
    q, scale, zero = quantize_groups(w[:, perm], s.group_size, s.sym, s.scale_dtype, zero_range)
    deq = _dequant_int4(q, scale, zero)
    inv = torch.argsort(perm)
    group = in_f if s.group_size == -1 else s.group_size
    g_idx = (torch.arange(in_f) // group)[inv].to(torch.int32) if s.desc_act else None
    return q[:, inv].contiguous(), scale, zero, deq[:, inv].contiguous(), g_idx


def pack_int32(values: torch.Tensor) -> torch.Tensor:
    """uint values 0..15 [..., 8c] -> int32 [..., c], value j of each eight in bits 4j..4j+3."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(8):
        word |= (v[..., j] & 0xF) << (4 * j)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def quantize_groups(w: torch.Tensor, group_size: int, sym: bool, scale_dtype: torch.dtype,
                    zero_range: tuple[int, int] = (0, 15)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [out, in] 0..15, scales [out, groups] as stored, zeros [out, groups] ints)."""
    out_f, in_f = w.shape
    group = in_f if group_size == -1 else group_size
    wg = w.float().reshape(out_f, in_f // group, group)
    if sym:
        scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-6).to(scale_dtype).float()
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).to(scale_dtype).float()
        zero = torch.round(-lo / scale).clamp(*zero_range)
    q = torch.round(wg / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(out_f, in_f).to(torch.uint8), scale.to(scale_dtype), zero


def _dequant_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    out_f, in_f = q.shape
    g = scale.shape[1]
    w = (q.float().reshape(out_f, g, in_f // g) - zero[..., None]) * scale.float()[..., None]
    return w.reshape(out_f, in_f)


def _awq(prefix: str, w: torch.Tensor, s: Scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, scale, zero = quantize_groups(w, s.group_size, False, s.scale_dtype)
    order = list(AWQ_PACK_ORDER)

    def pack_cols(t: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out/8], AWQ's order
        rows, cols = t.shape
        return pack_int32(t.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols))

    tensors = {
        f"{prefix}.qweight": pack_cols(q.T.contiguous()),
        f"{prefix}.qzeros": pack_cols(zero.to(torch.uint8).T.contiguous()),
        f"{prefix}.scales": scale.T.contiguous(),
    }
    return tensors, _dequant_int4(q, scale, zero)


def _gptq(prefix: str, w: torch.Tensor, s: Scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    v1 = s.gptq_format == "gptq"
    # v1 stores zero - 1 in four bits: a zero of 0 cannot be written.
    q, scale, zero, deq, g_idx = _grouped(w, s, (1 if v1 else 0, 15))
    in_f = w.shape[1]
    group = in_f if s.group_size == -1 else s.group_size
    stored_zero = zero.to(torch.int64) - (1 if v1 else 0)
    tensors = {
        f"{prefix}.qweight": pack_int32(q).T.contiguous(),  # packed along in: [in/8, out]
        f"{prefix}.qzeros": pack_int32(stored_zero.T.contiguous()),  # [groups, out/8]
        f"{prefix}.scales": scale.T.contiguous(),
        f"{prefix}.g_idx": g_idx if g_idx is not None else (torch.arange(in_f) // group).to(torch.int32),
    }
    return tensors, deq


def _ct_int4(prefix: str, w: torch.Tensor, s: Scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, scale, zero, deq, g_idx = _grouped(w, s)
    tensors = {
        f"{prefix}.weight_packed": pack_int32(q),  # [out, in/8]; stored = signed value + 8
        f"{prefix}.weight_scale": scale.contiguous(),
        f"{prefix}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
    }
    if not s.sym:  # signed zero point + 8, packed along out: [out/8, groups]
        tensors[f"{prefix}.weight_zero_point"] = pack_int32(zero.to(torch.uint8).T.contiguous()).T.contiguous()
    if g_idx is not None:
        tensors[f"{prefix}.weight_g_idx"] = g_idx
    return tensors, deq


def _fp8_scales(w: torch.Tensor, block: tuple[int, int] | None, per_channel: bool) -> torch.Tensor:
    out_f, in_f = w.shape
    a = w.float().abs()
    if block is not None:
        b0, b1 = block
        pad = torch.zeros(-(-out_f // b0) * b0, -(-in_f // b1) * b1)
        pad[:out_f, :in_f] = a
        amax = pad.reshape(pad.shape[0] // b0, b0, pad.shape[1] // b1, b1).amax((1, 3))
    elif per_channel:
        amax = a.amax(1, keepdim=True)
    else:
        amax = a.amax().reshape(1)
    return (amax / FP8_MAX).clamp(min=1e-12)


def _fp8(prefix: str, w: torch.Tensor, s: Scheme, per_channel: bool,
         scale_name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    block = s.fp8_block
    scale = _fp8_scales(w, block, per_channel).to(torch.float32)
    out_f, in_f = w.shape
    if block is not None:
        full = scale.repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    else:
        full = scale.reshape(-1, 1) if per_channel else scale.reshape(1, 1)
    f8 = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": f8, f"{prefix}.{scale_name}": scale}, f8.float() * full


def _config(s: Scheme) -> dict[str, Any]:
    if s.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": s.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if s.method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": s.group_size, "desc_act": s.desc_act,
                "sym": s.sym, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
                "lm_head": False, "checkpoint_format": s.gptq_format}
    if s.method == "fp8":
        cfg: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
        if s.fp8_block is not None:
            cfg["weight_block_size"] = list(s.fp8_block)
        return cfg
    if s.method == "ct-int4":
        strategy = "channel" if s.group_size == -1 else "group"
        weights = {"num_bits": 4, "type": "int", "symmetric": s.sym, "strategy": strategy,
                   "group_size": None if s.group_size == -1 else s.group_size, "dynamic": False,
                   "actorder": "group" if s.desc_act else None, "block_structure": None, "observer": "minmax"}
        inputs = None
        fmt = "pack-quantized"
    else:
        block = s.fp8_block
        weights = {"num_bits": 8, "type": "float", "symmetric": True,
                   "strategy": "block" if block else "channel", "group_size": None, "dynamic": False,
                   "block_structure": list(block) if block else None, "observer": "minmax"}
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
        fmt = "float-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def quantize_tensor(prefix: str, w: torch.Tensor, s: Scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's checkpoint tensors, and its dequantized float32 weight."""
    if s.method == "awq":
        return _awq(prefix, w, s)
    if s.method == "gptq":
        return _gptq(prefix, w, s)
    if s.method == "ct-int4":
        return _ct_int4(prefix, w, s)
    if s.method == "ct-fp8":
        return _fp8(prefix, w, s, per_channel=True, scale_name="weight_scale")
    if s.method == "fp8":
        return _fp8(prefix, w, s, per_channel=False,
                    scale_name="weight_scale_inv" if s.fp8_block is not None else "weight_scale")
    raise ValueError(f"method must be one of {METHODS}, got {s.method!r}")


def write_quantized(src: Path, dst: Path, scheme: Scheme, reference: Path | None = None) -> Path:
    """Quantize the float checkpoint folder `src` into `dst` (and its dequantized twin into `reference`)."""
    src, dst = Path(src), Path(dst)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _PROJ.match(name):
            prefix = name.removesuffix(".weight")
            packed, deq = quantize_tensor(prefix, t, scheme)
            out.update(packed)
            ref[name] = deq.to(torch.float32)
        else:
            out[name] = t.contiguous()
            ref[name] = t.float().contiguous()
    config = json.loads((src / "config.json").read_text())
    for folder, weights, quant in ((dst, out, _config(scheme)), (reference, ref, None)):
        if folder is None:
            continue
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(f, folder / f.name)
        cfg = dict(config)
        if quant is None:
            cfg.pop("quantization_config", None)
            cfg["torch_dtype"] = cfg["dtype"] = "float32"
        else:
            cfg["quantization_config"] = quant
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--sym", action="store_true")
    p.add_argument("--desc-act", action="store_true", help="gptq, ct-int4: act-order groups")
    p.add_argument("--gptq-format", choices=["gptq", "gptq_v2"], default="gptq")
    p.add_argument("--fp8-block", type=int, nargs=2, default=None, metavar=("ROWS", "COLS"))
    p.add_argument("--reference", type=Path, default=None, help="also write the dequantized float checkpoint here")
    a = p.parse_args(argv)
    block = tuple(a.fp8_block) if a.fp8_block else (128, 128) if a.method == "fp8" else None
    scheme = Scheme(a.method, a.group_size, a.sym, a.gptq_format, block, desc_act=a.desc_act)
    write_quantized(a.src, a.dst, scheme, a.reference)


if __name__ == "__main__":
    main()
