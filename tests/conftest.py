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

# Under pytest-xdist each worker gets its share of the cores for torch (and for OpenMP in the
# servers it starts): two workers each spinning two OpenMP threads on two cores wait on each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    import torch

    torch.set_num_threads(int(_threads))

# The suite runs in two pytest-xdist workers, a whole test file at a time (pyproject.toml's addopts).
# The files mapped to one name here run as one unit, in collection order, on one worker: each Ray
# module's server starts its own local Ray cluster, and test_cluster.py finds (and SIGKILLs) every
# EngineInstance actor process on the machine, another module's too. (A new module that starts Ray
# belongs here.)
SAME_WORKER = {"tests/server/test_cluster.py": "ray", "tests/server/test_pd_server.py": "ray"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadFileScheduling

    missing = [path for path in SAME_WORKER if not (config.rootpath / path).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py's SAME_WORKER names missing files: {missing}")

    class GroupedLoadFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SAME_WORKER.get(path, path)

    return GroupedLoadFileScheduling(config, log)


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
