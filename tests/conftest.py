"""Fixtures shared by every test folder: a small trained tokenizer and tiny random-weight checkpoints
(built by tiny_checkpoints.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dtype="auto" would pick bfloat16 on CPUs with AMX or AVX512-BF16; the suite's exactness checks
# against transformers need float32 on every machine (servers started by tests inherit this).
os.environ["TANDEM_AUTO_DTYPE"] = "float32"

# Test modules in every folder import the helper modules that sit here (tiny_checkpoints,
# scheduler_harness) by name.
sys.path.insert(0, str(Path(__file__).parent))
from tiny_checkpoints import build_model, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-model")
            cache[key] = build_model(out, tokenizer_dir, arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> Path:
    return model_factory("llama")
