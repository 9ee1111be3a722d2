"""What a `model` (or `tokenizer`) argument names, turned into the folder Tandem reads.

- a name from the pull registry (`smollm2-135m-instruct`): the file `tandem pull` put in the model
  cache (not pulled yet: a ValueError saying to pull it);
- a GGUF file, or a folder holding one GGUF file and no config.json: the folder prepared from it
  in the model cache (tandem/model/gguf_folder.py), with the tokenizer from its metadata;
- anything else: itself (a checkpoint folder, checked later by ModelConfig).

The entry points (LLMEngine, `tandem serve`, `tandem bench profile`) resolve their configuration
with `resolve_engine_config`, which also picks how a GGUF file's 4-bit blocks run: unset
`quantization` with dtype "auto" keeps them packed ("gguf"); an explicit dtype with no
quantization dequantizes every tensor to it (the exact path: `--dtype float32` gives what
transformers computes from the same file).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tandem.checkpoints.cache import cached_model, model_cache_dir
from tandem.checkpoints.registry import load_registry
from tandem.config import GGUF_CONFIG_KEY, GGUF_QUANTIZATION, EngineConfig
from tandem.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # the folder (or the argument, unchanged)
    name: str  # what to call it: the registry name, the GGUF file's name, or the folder's name
    gguf_file: str | None = None  # the GGUF file its weights come from


def resolve_model(model: str, cache_root: Path | None = None) -> ResolvedModel:
    root = model_cache_dir() if cache_root is None else cache_root
    path = Path(model).expanduser()
    registry = load_registry()
    if model in registry and not path.exists():
        entry = registry[model]
        cached = cached_model(entry, root)
        if cached is None:
            raise ValueError(f"model {model!r} is not pulled yet: run `tandem pull {model}` (into {root})")
        return _gguf(cached.path, root, model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf(path, root, path.name)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf(ggufs[0], root, ggufs[0].name)
        if len(ggufs) > 1:
            raise ValueError(
                f"{model!r} holds {len(ggufs)} GGUF files and no config.json: name one of them "
                f"({', '.join(g.name for g in ggufs[:4])})"
            )
    return ResolvedModel(model, path.name, _prepared_from(path))


def _gguf(file: Path, root: Path, name: str) -> ResolvedModel:
    from tandem.model.gguf_folder import prepared_folder

    return ResolvedModel(str(prepared_folder(file, root)), name, str(file.resolve()))


def _prepared_from(folder: Path) -> str | None:
    """The GGUF file a prepared folder was made from (None for any other folder)."""
    try:
        value = json.loads((folder / "config.json").read_text()).get(GGUF_CONFIG_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return str(value["file"]) if isinstance(value, dict) and isinstance(value.get("file"), str) else None


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """`config` with its model, tokenizer and draft model as folders Tandem reads, and a GGUF
    file's quantization decided (see the module's docstring). Folders pass through unchanged."""
    model = resolve_model(config.model)
    tokenizer = None if config.tokenizer is None else resolve_model(config.tokenizer).path
    if (
        model.gguf_file is not None
        and tokenizer is None
        and not (Path(model.path) / "tokenizer.json").is_file()
    ):
        raise ValueError(
            f"{model.gguf_file} holds no tokenizer: pass one (tokenizer=FOLDER / --tokenizer FOLDER)"
        )
    quantization = config.quantization
    if model.gguf_file is not None and quantization is None and config.dtype == "auto":
        quantization = GGUF_QUANTIZATION
    spec = config.speculative_config  # a SpeculativeConfig (EngineConfig parses it)
    if isinstance(spec, SpeculativeConfig) and isinstance(spec.model, str):
        spec = dataclasses.replace(spec, model=resolve_model(spec.model).path)
    changed = (model.path, tokenizer, quantization, spec) != (
        config.model,
        config.tokenizer,
        config.quantization,
        config.speculative_config,
    )
    if not changed:
        return config
    if model.gguf_file is not None:
        logger.info(
            "model %s: GGUF %s, read through %s; 4-bit blocks %s",
            config.model,
            model.gguf_file,
            model.path,
            "kept packed"
            if quantization in (GGUF_QUANTIZATION, "int8")
            else f"dequantized to {config.dtype}",
        )
    return dataclasses.replace(
        config, model=model.path, tokenizer=tokenizer, quantization=quantization, speculative_config=spec
    )
