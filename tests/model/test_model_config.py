"""Checkpoint folders Tandem cannot load are refused up front with a clear ValueError: an architecture it
does not implement is named in the message together with the supported ones, from `ModelConfig` and from
`LLM`, for the target and for a draft model."""

from __future__ import annotations

import json
import re

import pytest

from tandem import LLM
from tandem.config import SUPPORTED_ARCHITECTURES, ModelConfig

GPT2 = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 64,
    "n_head": 4,
    "n_layer": 2,
    "n_positions": 128,
    "vocab_size": 512,
}


def checkpoint(folder, config: dict):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def assert_names_the_architectures(message: str, unsupported: str) -> None:
    assert "unsupported architecture" in message
    assert unsupported in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message


def test_unsupported_architecture_from_model_config(tmp_path):
    path = checkpoint(tmp_path / "gpt2", GPT2)
    with pytest.raises(ValueError, match=re.escape("unsupported architecture ['GPT2LMHeadModel']")) as exc:
        ModelConfig.from_pretrained(path)
    assert_names_the_architectures(str(exc.value), "GPT2LMHeadModel")
    assert str(path / "config.json") in str(exc.value)


def test_missing_architectures_field(tmp_path):
    path = checkpoint(tmp_path / "bare", {k: v for k, v in GPT2.items() if k != "architectures"})
    with pytest.raises(ValueError, match=re.escape("unsupported architecture []")) as exc:
        ModelConfig.from_pretrained(path)
    assert_names_the_architectures(str(exc.value), "[]")


def test_unsupported_architecture_from_llm(tmp_path):
    path = checkpoint(tmp_path / "gpt2", GPT2)
    with pytest.raises(ValueError) as exc:
        LLM(model=str(path))
    assert_names_the_architectures(str(exc.value), "GPT2LMHeadModel")


def test_unsupported_draft_architecture_from_llm(tmp_path, llama_dir):
    draft = checkpoint(tmp_path / "gpt2", GPT2)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as exc:
        LLM(model=str(llama_dir), speculative_config=spec, num_threads=1)
    assert_names_the_architectures(str(exc.value), "GPT2LMHeadModel")
    assert str(draft / "config.json") in str(exc.value)
