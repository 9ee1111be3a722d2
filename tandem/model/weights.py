"""Reading a checkpoint's safetensors into a model's parameters, through the model's own mapping.

Each architecture says where a checkpoint tensor goes (`WeightMapping.checkpoint_target`: a
parameter, and where inside it, for fused or stacked parameters such as q/k/v in one matrix or
every expert's weights in one tensor) and which parts its parameters are made of
(`WeightMapping.param_parts`), so a missing tensor is an error naming it, not an uninitialised
weight. The loader itself knows no architecture.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


@dataclass(frozen=True, slots=True)
class Target:
    """Where one checkpoint tensor goes: `param[index...][rows[0]:rows[1]]`."""

    param: str
    index: tuple[int, ...] = ()  # leading indices into the parameter (e.g. the expert number)
    rows: tuple[int, int] | None = None  # a range of the next dimension (a shard of a fused matrix)

    @property
    def part(self) -> str:
        """The key that says this piece was loaded (a whole parameter is its own name)."""
        if not self.index and self.rows is None:
            return self.param
        return f"{self.param}{list(self.index)}{'' if self.rows is None else list(self.rows)}"


class WeightMapping(Protocol):
    def checkpoint_target(self, name: str) -> Target | None:
        """Where the checkpoint tensor `name` goes; None for a tensor the model does not use."""
        ...

    def param_parts(self, param: str) -> list[Target]:
        """The pieces the checkpoint must supply for parameter `param` (usually just itself)."""
        ...


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc!r}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint shard(s) listed in the index are missing: {', '.join(missing)}")
    return files


def checkpoint_tensors(folder: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, tensor name, tensor) for every tensor of the checkpoint, one file at a time."""
    for file in checkpoint_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield file.name, name, f.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc


def load_weights(
    model: nn.Module,
    mapping: WeightMapping,
    folder: Path,
    tensors: Iterable[tuple[str, str, torch.Tensor]] | None = None,
) -> None:
    """Copy the checkpoint's tensors (or `tensors`: (file, name, tensor), e.g. a quantized
    checkpoint's float ones, tandem/model/quantized_weights.py) into `model`'s parameters."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file, name, tensor in checkpoint_tensors(folder) if tensors is None else tensors:
        target = mapping.checkpoint_target(name)
        if target is None:
            continue
        param = params.get(target.param)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} in {file}")
        dst = param.data
        for i in target.index:
            dst = dst[i]
        if target.rows is not None:
            dst = dst[target.rows[0] : target.rows[1]]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(
                f"tensor {name!r} in {file} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        loaded.add(target.part)
    missing = [
        part.part for p in params for part in mapping.param_parts(p) if part.part not in loaded
    ]
    if missing:
        raise ValueError(
            f"checkpoint {folder} is missing tensors: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
