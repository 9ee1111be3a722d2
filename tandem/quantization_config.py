"""A checkpoint's own quantization (config.json's `quantization_config`), read into one small config.

Pure Python (no torch), like tandem/config.py which holds it. Formats read (the layouts are in
tandem/model/int4_formats.py and docs/quantized_checkpoints.md):

- `awq`: AutoAWQ GEMM, 4 bits, group-wise with zero points;
- `gptq`: AutoGPTQ / GPTQModel, 4 bits, `desc_act` false or true (act-order), `sym` true or
  false, `checkpoint_format` "gptq" (v1 zeros) or "gptq_v2";
- `compressed-tensors`: `pack-quantized` int4 weights (group or channel, with or without zero
  points, `actorder` too) and `float-quantized` FP8 weights (channel, tensor or block scales);
- `fp8`: float8_e4m3fn weights with `weight_scale_inv` per block (`weight_block_size`, as
  DeepSeek-V3 and Qwen3-FP8 ship) or a `weight_scale` per tensor or channel.

Anything else is a ValueError naming what is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
# vLLM's names for kernels of the same formats: `--quantization awq_marlin` means "awq" here.
METHOD_ALIASES = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "compressed_tensors": "compressed-tensors",
}
_CT_FORMATS = ("pack-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    method: str  # one of CHECKPOINT_METHODS
    weights: str  # "int4" or "fp8": what the quantized linear layers hold
    bits: int
    # Inputs per scale (and zero point); None: one group over the whole input (per channel).
    group_size: int | None
    # int4: zero points stored (asymmetric); False means the fixed midpoint 8.
    zero_point: bool
    desc_act: bool = False
    # gptq: "gptq" (v1, zeros stored minus one) or "gptq_v2"; compressed-tensors: its `format`.
    checkpoint_format: str = ""
    # fp8: the block of weight elements one scale covers ([out, in]), None for tensor/channel scales.
    weight_block: tuple[int, int] | None = None

    @staticmethod
    def from_hf(cfg: dict[str, Any] | None) -> QuantizationConfig | None:
        """Parse `quantization_config`; None when the checkpoint has none."""
        if cfg is None:
            return None
        if not isinstance(cfg, dict):
            raise ValueError(f"quantization_config must be an object, got {cfg!r}")
        method = str(cfg.get("quant_method", "")).lower()
        if method == "awq":
            return _awq(cfg)
        if method == "gptq":
            return _gptq(cfg)
        if method == "compressed-tensors":
            return _compressed_tensors(cfg)
        if method == "fp8":
            return _fp8(cfg)
        raise ValueError(
            f"quantization_config: quant_method {cfg.get('quant_method')!r} is not supported "
            f"(supported: {', '.join(CHECKPOINT_METHODS)})"
        )


def _group(value: Any, what: str) -> int | None:
    if value is None or int(value) == -1:
        return None
    group = int(value)
    if group <= 0:
        raise ValueError(f"quantization_config: {what} group_size must be positive or -1, got {value!r}")
    return group


def _four_bits(bits: Any, what: str) -> None:
    if bits != 4:
        raise ValueError(f"quantization_config: {what} with bits={bits!r} is not supported (4-bit only)")


def _awq(cfg: dict[str, Any]) -> QuantizationConfig:
    bits = cfg.get("bits", cfg.get("w_bit"))
    _four_bits(bits, "awq")
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config: awq version {version!r} is not supported (GEMM layout only)")
    if not cfg.get("zero_point", True):
        raise ValueError("quantization_config: awq without zero points (zero_point: false) is not supported")
    return QuantizationConfig(
        method="awq",
        weights="int4",
        bits=4,
        group_size=_group(cfg.get("group_size", cfg.get("q_group_size")), "awq"),
        zero_point=True,
        checkpoint_format="gemm",
    )


def _gptq(cfg: dict[str, Any]) -> QuantizationConfig:
    _four_bits(cfg.get("bits"), "gptq")
    fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"quantization_config: gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)"
        )
    if cfg.get("dynamic"):
        raise ValueError("quantization_config: gptq per-module overrides (dynamic) are not supported")
    return QuantizationConfig(
        method="gptq",
        weights="int4",
        bits=4,
        group_size=_group(cfg.get("group_size"), "gptq"),
        zero_point=not bool(cfg.get("sym", True)),
        desc_act=bool(cfg.get("desc_act", False)),
        checkpoint_format=fmt,
    )


def _ct_weights(cfg: dict[str, Any]) -> dict[str, Any]:
    """The one weight scheme every config group shares."""
    groups = cfg.get("config_groups") or {}
    schemes: list[dict[str, Any]] = [
        g["weights"] for g in groups.values() if isinstance(g, dict) and isinstance(g.get("weights"), dict)
    ]
    if not schemes:
        raise ValueError("quantization_config: compressed-tensors config_groups quantize no weights")
    keys = ("num_bits", "type", "strategy", "group_size", "symmetric", "block_structure", "actorder")
    first = {k: schemes[0].get(k) for k in keys}
    if any({k: s.get(k) for k in keys} != first for s in schemes[1:]):
        raise ValueError(
            "quantization_config: compressed-tensors checkpoints whose config groups use different "
            "weight schemes are not supported"
        )
    return schemes[0]


def _compressed_tensors(cfg: dict[str, Any]) -> QuantizationConfig:
    fmt = str(cfg.get("format", ""))
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"quantization_config: compressed-tensors format {fmt!r} is not supported "
            "(pack-quantized int4, float-quantized FP8)"
        )
    sparsity = cfg.get("sparsity_config")
    if sparsity and str(sparsity.get("format", "dense")) != "dense":
        raise ValueError("quantization_config: compressed-tensors sparsity is not supported")
    w = _ct_weights(cfg)
    kind, bits, strategy = str(w.get("type", "int")), w.get("num_bits"), str(w.get("strategy", ""))
    if w.get("dynamic"):
        raise ValueError("quantization_config: compressed-tensors dynamic weight quantization is not supported")
    if kind == "float":
        if bits != 8:
            raise ValueError(f"quantization_config: compressed-tensors float weights of {bits} bits are not supported")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"quantization_config: compressed-tensors FP8 strategy {strategy!r} is not supported")
        block = w.get("block_structure")
        weight_block = None
        if strategy == "block":
            if not (isinstance(block, list) and len(block) == 2):
                raise ValueError(
                    "quantization_config: compressed-tensors block strategy needs block_structure [rows, cols]"
                )
            weight_block = (int(block[0]), int(block[1]))
        return QuantizationConfig(
            method="compressed-tensors",
            weights="fp8",
            bits=8,
            group_size=None,
            zero_point=False,
            checkpoint_format=fmt,
            weight_block=weight_block,
        )
    if kind != "int":
        raise ValueError(f"quantization_config: compressed-tensors weight type {kind!r} is not supported")
    _four_bits(bits, "compressed-tensors int weights")
    if fmt != "pack-quantized":
        raise ValueError(f"quantization_config: compressed-tensors int4 weights in format {fmt!r} are not supported")
    if strategy not in ("group", "channel"):
        raise ValueError(f"quantization_config: compressed-tensors int4 strategy {strategy!r} is not supported")
    return QuantizationConfig(
        method="compressed-tensors",
        weights="int4",
        bits=4,
        group_size=_group(w.get("group_size"), "compressed-tensors") if strategy == "group" else None,
        zero_point=not bool(w.get("symmetric", True)),
        checkpoint_format=fmt,
    )


def _fp8(cfg: dict[str, Any]) -> QuantizationConfig:
    fmt = str(cfg.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: fp8 fmt {fmt!r} is not supported (e4m3)")
    block = cfg.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2):
        raise ValueError(f"quantization_config: fp8 weight_block_size must be [rows, cols], got {block!r}")
    return QuantizationConfig(
        method="fp8",
        weights="fp8",
        bits=8,
        group_size=None,
        zero_point=False,
        checkpoint_format="fp8",
        weight_block=None if block is None else (int(block[0]), int(block[1])),
    )


def resolve_method(requested: str | None, checkpoint: QuantizationConfig | None) -> str | None:
    """The at-load quantization to apply ("int8" or None) given the engine's `quantization`
    argument and the checkpoint's own; a disagreement is a ValueError.

    "int8" on a 4-bit checkpoint quantizes the layers it keeps in float (the LM head, as GPTQ and
    AWQ tools leave it) and keeps the 4-bit ones: llama.cpp's 4-bit files likewise hold the
    output layer at 6 or 8 bits, and at one stream the float head is a fifth of the bytes read."""
    name = METHOD_ALIASES.get(requested or "", requested)
    if checkpoint is not None:
        if name == "int8" and checkpoint.weights == "int4":
            return name
        if name not in (None, checkpoint.method):
            raise ValueError(
                f"quantization={requested!r}, but the checkpoint is already quantized with "
                f"{checkpoint.method!r} (leave quantization unset or pass {checkpoint.method!r}"
                + (", or 'int8' for its float layers)" if checkpoint.weights == "int4" else ")")
            )
        return None
    if name in CHECKPOINT_METHODS:
        raise ValueError(
            f"quantization={requested!r} needs a checkpoint quantized that way (config.json's "
            "quantization_config); this one has none (quantization='int8' quantizes a float checkpoint at load)"
        )
    return name
