"""Loading a quantized checkpoint's linear layers through the model's weight mapping.

4-bit layers (AWQ, GPTQ, compressed-tensors pack-quantized) are read first, converted by
tandem/model/int4_formats.py and assembled into `Int4Linear` modules, one per model linear (the
checkpoint's q/k/v or gate/up shards fused in the rows the mapping gives them); the float loader
then reads everything else from `tensors()`, which leaves the 4-bit tensors out and hands FP8
weights over dequantized (times their scales), so they load like any float weight. Where FP8
layers run `torch._scaled_mm` (tandem/model/fp8_linear.py), `fp8_linears` then reads their float8
bytes and scales again and builds those layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tandem.model.fp8_linear import DIM_MULTIPLE, Fp8Layers, Fp8Linear, ScaledMM, row_scales
from tandem.model.int4 import DequantScratch, Int4Linear, check_shape, fuse_int4
from tandem.model.int4_formats import dequantize_fp8, read_awq, read_compressed_tensors, read_gptq
from tandem.model.weights import WeightMapping, checkpoint_files
from tandem.quantization_config import QuantizationConfig

# The tensor of each 4-bit layer that marks it, by format, and every tensor such a layer has.
_INT4_MARK = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}
_INT4_PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}
# Activation and KV-cache scales of FP8 checkpoints: Tensors computed in float here do not use them.
_UNUSED_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale", "kv_scale")


class QuantizedCheckpoint:
    def __init__(self, qcfg: QuantizationConfig, folder: Path) -> None:
        self.qcfg = qcfg
        self.folder = folder
        # The one dequantization buffer this checkpoint's 4-bit layers share.
        self.scratch = DequantScratch()
        self._handles: dict[Path, Any] = {}
        self.where: dict[str, Path] = {}
        for file in checkpoint_files(folder):
            for name in self._open(file).keys():  # noqa: SIM118 - safe_open is not a mapping
                self.where[name] = file
        mark = _INT4_MARK.get(qcfg.method) if qcfg.weights == "int4" else None
        suffix = f".{mark}"
        self.int4_prefixes = sorted(n.removesuffix(suffix) for n in self.where if mark and n.endswith(suffix))
        self.fp8_prefixes = sorted(
            n.removesuffix(".weight")
            for n in self.where
            if qcfg.weights == "fp8" and n.endswith(".weight") and self._is_fp8(n)
        )

    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except SafetensorError as exc:
                raise ValueError(f"cannot read weights from {file}: {exc}") from exc
        return self._handles[file]

    def _is_fp8(self, name: str) -> bool:
        return str(self._open(self.where[name]).get_slice(name).get_dtype()) == "F8_E4M3"

    def get(self, name: str) -> torch.Tensor:
        return self._open(self.where[name]).get_tensor(name)

    def _maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.where else None

    def _need(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"{self.qcfg.method} checkpoint {self.folder} is missing tensor {name!r}")
        return self.get(name)

    def read_int4(self, prefix: str) -> Int4Linear:
        qc, method = self.qcfg, self.qcfg.method
        if method == "awq":
            q, s, z, perm = read_awq(prefix, self._need(f"{prefix}.qweight"), self._need(f"{prefix}.qzeros"),
                               self._need(f"{prefix}.scales"), qc.group_size)
        elif method == "gptq":
            q, s, z, perm = read_gptq(prefix, self._need(f"{prefix}.qweight"), self._need(f"{prefix}.qzeros"),
                                self._need(f"{prefix}.scales"), self._maybe(f"{prefix}.g_idx"), qc.group_size,
                                v1=qc.checkpoint_format == "gptq")
        else:
            zp = self._maybe(f"{prefix}.weight_zero_point")
            if qc.zero_point and zp is None:
                raise ValueError(f"{prefix}: asymmetric compressed-tensors weights need weight_zero_point")
            q, s, z, perm = read_compressed_tensors(prefix, self._need(f"{prefix}.weight_packed"),
                                              self._need(f"{prefix}.weight_scale"), zp,
                                              self._maybe(f"{prefix}.weight_shape"),
                                              self._maybe(f"{prefix}.weight_g_idx"))
        group = q.shape[1] // s.shape[1]
        check_shape(q.shape[1], group, prefix)
        return Int4Linear(q, s, z, group, None, in_perm=perm, scratch=self.scratch)

    def int4_layers(self, model: nn.Module, mapping: WeightMapping) -> dict[str, Int4Linear]:
        """Model module name -> its 4-bit layer (bias not set: it loads with the float tensors)."""
        parts: dict[str, dict[tuple[int, int] | None, Int4Linear]] = {}
        params = dict(model.named_parameters())
        for prefix in self.int4_prefixes:
            target = mapping.checkpoint_target(f"{prefix}.weight")
            if target is None:
                continue
            if target.param not in params or not target.param.endswith(".weight"):
                raise ValueError(f"unexpected quantized layer {prefix!r} in {self.folder}")
            if target.index:
                raise ValueError(f"{prefix}: 4-bit weights of stacked (expert) parameters are not supported")
            lin = self.read_int4(prefix)
            expect = params[target.param].shape
            rows = expect[0] if target.rows is None else target.rows[1] - target.rows[0]
            if (lin.out_features, lin.in_features) != (rows, expect[1]):
                raise ValueError(
                    f"{prefix} holds a [{lin.out_features}, {lin.in_features}] weight, "
                    f"expected [{rows}, {expect[1]}]"
                )
            parts.setdefault(target.param, {})[target.rows] = lin
        layers: dict[str, Int4Linear] = {}
        for param, got in parts.items():
            needed = [t.rows for t in mapping.param_parts(param)]
            missing = [r for r in needed if r not in got]
            if missing:
                raise ValueError(
                    f"checkpoint {self.folder}: {param} is 4-bit in some of its parts but rows "
                    f"{missing} are missing or not quantized the same way"
                )
            pieces = [got[r] for r in needed]
            try:
                layers[param.removesuffix(".weight")] = pieces[0] if len(pieces) == 1 else fuse_int4(pieces, None)
            except ValueError as exc:
                raise ValueError(f"checkpoint {self.folder}: cannot fuse the parts of {param}: {exc}") from exc
        return layers

    def fp8_linears(self, model: nn.Module, mapping: WeightMapping, matmul: ScaledMM | None = None) -> Fp8Layers:
        """The fp8 layers that can run `torch._scaled_mm` (tandem/model/fp8_linear.py), built from
        the checkpoint's own fp8 bytes and scales (the loaded float copy was rounded to the model
        dtype, so it cannot give them back), on the device and with the bias of the loaded
        `nn.Linear` each replaces; and, by parameter, why the others stay widened."""
        found = Fp8Layers()
        modules = dict(model.named_modules())
        # Names first, bytes one layer at a time: the host never holds more than one layer's.
        prefixes: dict[str, dict[tuple[int, int] | None, str]] = {}
        for prefix in self.fp8_prefixes:
            target = mapping.checkpoint_target(f"{prefix}.weight")
            if target is None:
                continue
            if target.index or not isinstance(modules.get(target.param.removesuffix(".weight")), nn.Linear):
                found.widened[target.param] = "stacked experts"
                continue
            prefixes.setdefault(target.param, {})[target.rows] = prefix
        for param, got in prefixes.items():
            if param in found.widened:
                continue
            needed = [t.rows for t in mapping.param_parts(param)]
            if any(r not in got for r in needed):
                found.widened[param] = "fused with shards that are not fp8"
                continue
            shards = [self._fp8_rows(got[r]) for r in needed]
            if any(scale is None for _, scale in shards):
                found.widened[param] = "block scales"
                continue
            q = torch.cat([w for w, _ in shards])
            scale = torch.cat([s for _, s in shards if s is not None])
            layer = param.removesuffix(".weight")
            lin = modules[layer]
            if tuple(q.shape) != tuple(lin.weight.shape):
                raise ValueError(
                    f"checkpoint {self.folder}: {param} is {tuple(q.shape)} in fp8, expected {tuple(lin.weight.shape)}"
                )
            if q.shape[0] % DIM_MULTIPLE or q.shape[1] % DIM_MULTIPLE:
                found.widened[param] = f"dimensions not multiples of {DIM_MULTIPLE}"
                continue
            device = lin.weight.device
            found.layers[layer] = Fp8Linear(q.to(device), scale.to(device), lin.bias, matmul)
        return found

    def _fp8_rows(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An fp8 layer's float8 weight and its scale per row (None: block scales)."""
        scale = self._maybe(f"{prefix}.weight_scale_inv")
        if scale is None:
            scale = self._need(f"{prefix}.weight_scale")
        q = self.get(f"{prefix}.weight")
        return q, row_scales(prefix, scale, q.shape[0])

    def tensors(self, model_params: set[str], mapping: WeightMapping) -> Iterator[tuple[str, str, torch.Tensor]]:
        """Every other tensor for the float loader: FP8 weights dequantized, 4-bit ones left out."""
        int4 = set(self.int4_prefixes)
        fp8 = set(self.fp8_prefixes)
        for name, file in self.where.items():
            prefix, _, leaf = name.rpartition(".")
            if prefix in int4:
                if leaf in _INT4_PARTS[self.qcfg.method]:
                    continue
                if leaf == "bias" and self._unused_zero_bias(name, model_params, mapping):
                    continue
            if leaf in _UNUSED_SCALES:
                continue
            if prefix in fp8:
                if leaf in ("weight_scale", "weight_scale_inv"):
                    continue
                if leaf == "weight":
                    scale = self._maybe(f"{prefix}.weight_scale_inv")
                    if scale is None:
                        scale = self._need(f"{prefix}.weight_scale")
                    w = dequantize_fp8(prefix, self.get(name), scale, self.qcfg.weight_block, torch.float32)
                    yield file.name, name, w
                    continue
            yield file.name, name, self.get(name)

    def _unused_zero_bias(self, name: str, model_params: set[str], mapping: WeightMapping) -> bool:
        """GPTQ writers store an all-zero bias for layers that have none."""
        target = mapping.checkpoint_target(name)
        return target is not None and target.param not in model_params and not bool(self.get(name).any())


class BiasOnly(nn.Module):
    """Stands in for a 4-bit layer while the float tensors load: only its bias (if any) is read."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.data, requires_grad=False)


def swap_module(root: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, leaf)
    setattr(parent, leaf, new)
    return old
