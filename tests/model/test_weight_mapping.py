"""The checkpoint loader through an architecture's weight mapping: every piece present, none extra."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.config import ModelConfig
from tandem.model.loader import load_model


def _copy_without(src: Path, dst: Path, drop: str | None = None, add: str | None = None) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop is not None:
        del tensors[drop]
    if add is not None:
        tensors[add] = torch.zeros(4)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(folder: Path):
    return load_model(ModelConfig.from_pretrained(folder), torch.float32, torch.device("cpu"), "torch", 64)


def test_fused_shards_fill_their_rows(llama_dir: Path) -> None:
    model = _load(llama_dir)
    ref = load_file(str(llama_dir / "model.safetensors"))
    layer = model.layers[1]  # type: ignore[attr-defined]
    qkv = layer.self_attn.qkv_proj
    weight = qkv.plain if hasattr(qkv, "plain") and qkv.plain is not None else qkv.weight
    q, k = ref["model.layers.1.self_attn.q_proj.weight"], ref["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(weight[: q.shape[0]], q)
    assert torch.equal(weight[q.shape[0] : q.shape[0] + k.shape[0]], k)


def test_a_missing_shard_of_a_fused_weight_is_named(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_without(llama_dir, tmp_path / "m", drop="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensors: layers\.0\.self_attn\.qkv_proj\.weight"):
        _load(folder)


def test_a_missing_plain_weight_is_named(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_without(llama_dir, tmp_path / "m", drop="model.norm.weight")
    with pytest.raises(ValueError, match=r"missing tensors: norm\.weight"):
        _load(folder)


def test_an_unknown_tensor_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_without(llama_dir, tmp_path / "m", add="model.layers.0.mystery.weight")
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        _load(folder)


def test_loaded_submodules_are_plain_attributes_and_stay_replaceable(llama_dir: Path) -> None:
    model = _load(llama_dir)
    attn = model.layers[0].self_attn  # type: ignore[attr-defined]
    assert attn.__dict__["o_proj"] is attn._modules["o_proj"] is attn.o_proj
    x = torch.randn(3, attn.q_size)
    before = attn.o_proj(x)
    new = torch.nn.Linear(attn.q_size, before.shape[-1], bias=False)
    attn.o_proj = new  # nn.Module.__setattr__ drops the bound copy
    assert attn.o_proj is new and attn._modules["o_proj"] is new and "o_proj" not in attn.__dict__
    assert dict(model.named_modules())["layers.0.self_attn.o_proj"] is new  # type: ignore[attr-defined]
