"""dtype="auto": bfloat16 where the CPU multiplies it natively, float32 elsewhere; overridable."""

from __future__ import annotations

import pytest
import torch

from tandem.model import loader


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(loader.AUTO_DTYPE_ENV, raising=False)

    def set_cpu(flags: set[str], packs_bf16: bool = True) -> None:
        monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(loader, "onednn_available", lambda dtype: packs_bf16)

    return set_cpu


def test_avx2_only_cpu_gets_float32(cpu) -> None:
    cpu({"avx2", "fma"})
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "no AMX-BF16" in loader.auto_dtype(torch.device("cpu"))[1]


@pytest.mark.parametrize("flag", ["amx_bf16", "avx512_bf16"])
def test_native_bf16_cpu_gets_bfloat16_and_says_why(cpu, flag: str) -> None:
    cpu({"avx512f", flag})
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert flag in loader.auto_dtype(torch.device("cpu"))[1]


def test_bf16_flags_without_onednn_packing_stay_float32(cpu) -> None:
    cpu({"amx_bf16"}, packs_bf16=False)
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_explicit_dtype_wins_over_the_cpu(cpu) -> None:
    cpu({"amx_bf16"})
    assert loader.resolve_dtype("float32", torch.device("cpu")) == torch.float32
    cpu(set())
    assert loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_environment_override(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu({"amx_bf16"})
    monkeypatch.setenv(loader.AUTO_DTYPE_ENV, "float32")
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setenv(loader.AUTO_DTYPE_ENV, "int4")
    with pytest.raises(ValueError, match=loader.AUTO_DTYPE_ENV):
        loader.resolve_dtype("auto", torch.device("cpu"))
