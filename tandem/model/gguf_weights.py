"""A GGUF file's tensors through the model's weight mapping (tandem/model/weights.py).

Each GGUF tensor is renamed to the Hugging Face name its architecture's checkpoints use (the names
llama.cpp's converter maps from, gguf-py's tensor_mapping.py), so the architecture's own mapping
places it (q/k/v into qkv_proj, experts into their stacked tensors) and a tensor the model lacks
is an error, as for a safetensors checkpoint. On the way, what llama.cpp's converter changed is
undone: the rotary permutation of Llama's q and k rows, Gemma's norm weights stored plus one, the
experts stacked in one tensor per projection.

With `packed`, every linear layer whose parts are all Q4_0, Q4_1 or Q4_K becomes an `Int4Linear`
over those blocks as they are (tandem/model/gguf_blocks.py); the rest is dequantized by ggml's
reader (a fused layer with a part of another type, e.g. Q6_K v beside Q4_K q and k in Q4_K_M files,
is dequantized whole). `report` says afterwards what went which way, and the bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tandem.config import GGUF_QUANTIZATION, ModelConfig
from tandem.model.gguf_blocks import (
    GROUP_SIZE,
    can_pack,
    dequantize,
    int4_parts,
    rope_unpermutation,
    type_name,
)
from tandem.model.gguf_config import field as metadata_field
from tandem.model.gguf_config import open_reader
from tandem.model.int4 import DequantScratch, Int4Linear, fuse_int4
from tandem.model.weights import Target, WeightMapping

# GGUF name -> Hugging Face name, outside the layers.
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# blk.N.<GGUF> -> model.layers.N.<Hugging Face>.
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Where an architecture's converter uses a name differently.
_ARCH_LAYER = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # Phi-3's gate and up rows in one tensor, as its checkpoints
}
# Stacked experts [experts, out, in] -> each expert's projection.
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Tensors the config already holds (tandem/model/gguf_config.py).
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")
# Architectures whose q and k rows llama.cpp's converter permuted (its LlamaModel.permute).
_PERMUTED = ("llama",)
_GEMMA = ("gemma2", "gemma3")


def gguf_mode(quantization: str | None) -> tuple[bool, str | None]:
    """(keep 4-bit blocks packed, at-load quantization) for a GGUF file's `quantization`: "gguf"
    packs; "int8" packs and quantizes the float layers to int8 (as on a 4-bit checkpoint); None
    dequantizes everything to the model's dtype (the entry points turn None into "gguf" when the
    dtype is auto: tandem/checkpoints/resolve.py)."""
    if quantization in (GGUF_QUANTIZATION, "int8"):
        return True, "int8" if quantization == "int8" else None
    if quantization is None:
        return False, None
    raise ValueError(
        f"quantization={quantization!r} does not apply to a GGUF file (gguf: keep its 4-bit blocks packed; "
        "int8: that and int8 for its other linear layers; unset: as the dtype says)"
    )


@dataclass
class GGUFLoadReport:
    """Counts and bytes by ggml type: kept packed (4-bit bytes) and dequantized (bytes in `dtype`)."""

    dtype: torch.dtype
    packed: dict[str, int] = field(default_factory=dict)
    packed_bytes: int = 0
    dequantized: dict[str, int] = field(default_factory=dict)
    dequantized_bytes: dict[str, int] = field(default_factory=dict)
    mixed_layers: list[str] = field(default_factory=list)

    def add_dequantized(self, kind: str, numel: int) -> None:
        self.dequantized[kind] = self.dequantized.get(kind, 0) + 1
        size = numel * torch.empty((), dtype=self.dtype).element_size()
        self.dequantized_bytes[kind] = self.dequantized_bytes.get(kind, 0) + size

    def summary(self) -> str:
        mb = 2.0**20
        dtype = str(self.dtype).removeprefix("torch.")
        parts = []
        if self.packed:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.packed.items()))
            parts.append(
                f"kept packed for the 4-bit kernels: {kinds} tensors ({self.packed_bytes / mb:.1f} MB)"
            )
        if self.dequantized:
            kinds = ", ".join(
                f"{n} {k} ({self.dequantized_bytes[k] / mb:.1f} MB)"
                for k, n in sorted(self.dequantized.items())
            )
            total = sum(self.dequantized_bytes.values()) / mb
            parts.append(f"dequantized to {dtype} at load: {kinds}; {total:.1f} MB in all")
        if self.mixed_layers:
            parts.append(
                f"{len(self.mixed_layers)} fused layers mix 4-bit and other types and are dequantized "
                f"(e.g. {self.mixed_layers[0]})"
            )
        return "; ".join(parts)


class GGUFCheckpoint:
    """The loader's view of a GGUF file (the interface of quantized_weights.QuantizedCheckpoint)."""

    def __init__(self, cfg: ModelConfig, packed: bool, dtype: torch.dtype) -> None:
        if cfg.gguf_file is None:
            raise ValueError(f"{cfg.path} is not a folder prepared from a GGUF file")
        self.cfg = cfg
        self.file = cfg.gguf_file
        self.reader = open_reader(cfg.gguf_file)
        self.arch = str(metadata_field(self.reader, "general.architecture"))
        self.packed = packed
        self.report = GGUFLoadReport(dtype)
        self.scratch = DequantScratch()
        self._layer_names = {**_LAYER, **_ARCH_LAYER.get(self.arch, {})}
        # GGUF names the 4-bit layers took; the float loader skips them.
        self._taken: set[str] = set()
        # Model parameter -> the ggml types of the tensors it was read from (those dequantized).
        self._source_types: dict[str, set[str]] = {}

    # -- names ------------------------------------------------------------------------------------

    def hf_names(self, name: str, experts: int = 0) -> list[str]:
        """The Hugging Face name(s) of GGUF tensor `name` (one per expert for stacked experts);
        [] for tensors the config holds. An unknown name is a ValueError."""
        if name in _CONFIG_TENSORS:
            return []
        stem, _, leaf = name.rpartition(".")
        if stem in _GLOBAL:
            return [f"{_GLOBAL[stem]}.{leaf}"]
        m = _LAYER_RE.match(name)
        if m is None:
            raise ValueError(f"{self.file}: tensor {name!r} is not one Tandem knows for {self.arch}")
        layer, kind, expert, leaf = m.group(1), m.group(2), m.group(3), m.group(4)
        prefix = f"model.layers.{layer}"
        if kind in _EXPERTS:
            return [f"{prefix}.mlp.experts.{e}.{_EXPERTS[kind]}.{leaf}" for e in range(experts)]
        if expert is not None and kind in ("ffn_gate", "ffn_up", "ffn_down"):  # older Mixtral files
            return [f"{prefix}.mlp.experts.{expert}.{kind.removeprefix('ffn_')}_proj.{leaf}"]
        if kind not in self._layer_names or expert is not None:
            raise ValueError(f"{self.file}: tensor {name!r} is not one Tandem knows for {self.arch}")
        return [f"{prefix}.{self._layer_names[kind]}.{leaf}"]

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        if self.arch not in _PERMUTED:
            return None
        if ".attn_q." in name:
            return rope_unpermutation(rows, self.cfg.num_heads)
        if ".attn_k." in name:
            return rope_unpermutation(rows, self.cfg.num_kv_heads)
        return None

    # -- the loader's interface -------------------------------------------------------------------

    def int4_layers(self, model: nn.Module, mapping: WeightMapping) -> dict[str, Int4Linear]:
        """Model module name -> its 4-bit layer, for the linear layers whose parts are all packable
        (none unless `packed`); biases load with the float tensors."""
        if not self.packed:
            return {}
        found: dict[str, dict[tuple[int, int] | None, Any]] = {}
        for t in self.reader.tensors:
            if not t.name.endswith(".weight") or t.name in _CONFIG_TENSORS or len(t.data.shape) != 2:
                continue
            (hf,) = self.hf_names(t.name)
            target = mapping.checkpoint_target(hf)
            if target is None or target.index or not _is_linear(model, target):
                continue
            found.setdefault(target.param, {})[target.rows] = t
        layers: dict[str, Int4Linear] = {}
        for param, parts in found.items():
            needed = [p.rows for p in mapping.param_parts(param)]
            tensors = [parts.get(rows) for rows in needed]
            # (A packable type's blocks are whole groups of 32: every such row length suits the kernel.)
            packable = [t is not None and can_pack(t) for t in tensors]
            if not any(packable):
                continue
            if not all(packable):
                kinds = sorted({type_name(t) for t in tensors if t is not None})
                self.report.mixed_layers.append(f"{param} ({', '.join(kinds)})")
                continue
            pieces = [self._int4(t) for t in tensors if t is not None]
            layers[param.removesuffix(".weight")] = pieces[0] if len(pieces) == 1 else fuse_int4(pieces, None)
        return layers

    def eight_bit_params(self) -> set[str]:
        """Parameters read only from 8-bit blocks (Q8_0): with the 4-bit blocks packed, their
        linear layers run as int8 (one byte a weight, as the file stores them) rather than at
        twice that in the serving dtype. SmolLM2's tied LM head is one."""
        if not self.packed:
            return set()
        return {param for param, kinds in self._source_types.items() if kinds == {"Q8_0"}}

    def _int4(self, tensor: Any) -> Int4Linear:
        qweight, scales, zs = int4_parts(tensor)
        order = self._row_order(tensor.name, qweight.shape[0])
        if order is not None:
            qweight, scales = qweight[order], scales[order]
            zs = None if zs is None else zs[order]
        self._taken.add(tensor.name)
        kind = type_name(tensor)
        self.report.packed[kind] = self.report.packed.get(kind, 0) + 1
        self.report.packed_bytes += sum(
            x.numel() * x.element_size() for x in (qweight, scales, zs) if x is not None
        )
        return Int4Linear.from_packed(qweight, scales, zs, GROUP_SIZE, scratch=self.scratch)

    def tensors(self, params: set[str], mapping: WeightMapping) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(file name, Hugging Face name, float32 tensor) for every tensor the 4-bit layers did not take."""
        file = self.file.rpartition("/")[2]
        experts = self.cfg.moe.num_experts if self.cfg.moe is not None else 0
        for t in self.reader.tensors:
            if t.name in self._taken:
                continue
            names = self.hf_names(t.name, experts)
            if not names:
                continue
            value = dequantize(t)
            self.report.add_dequantized(type_name(t), value.numel())
            target = mapping.checkpoint_target(names[0]) if len(names) == 1 else None
            if target is not None:
                self._source_types.setdefault(target.param, set()).add(type_name(t))
            order = self._row_order(t.name, value.shape[0])
            if order is not None:
                value = value[order]
            if self.arch in _GEMMA and t.name.endswith("norm.weight"):
                value = value - 1.0  # stored as Gemma's 1 + w
            if len(names) > 1:
                if value.dim() != 3 or value.shape[0] != len(names):
                    raise ValueError(
                        f"{self.file}: {t.name} has shape {tuple(value.shape)}, expected {len(names)} experts"
                    )
                for name, part in zip(names, value.unbind(0)):
                    yield file, name, part
                continue
            if t.name.endswith("ffn_gate_inp_shexp.weight") and value.dim() == 1:
                value = value[None]  # the shared expert's gate is one output row
            yield file, names[0], value


def _is_linear(model: nn.Module, target: Target) -> bool:
    if not target.param.endswith(".weight"):
        return False
    try:
        return isinstance(model.get_submodule(target.param.removesuffix(".weight")), nn.Linear)
    except AttributeError:
        return False
