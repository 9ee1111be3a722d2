"""A folder Tandem reads as it reads a checkpoint, made once from a GGUF file.

It holds config.json (with the GGUF file's path under `tandem_gguf`, where the loader finds the
weights: they are never copied), generation_config.json, and the tokenizer with its chat template,
built from the file's metadata by transformers' GGUF tokenizer converters (the same code
`AutoTokenizer.from_pretrained(..., gguf_file=...)` runs). The folder is keyed by the file's path,
size and modification time, so a changed file gets a new one; it is written to a temporary name and
renamed, so processes preparing the same file at once never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tandem.config import GGUF_CONFIG_KEY
from tandem.model.gguf_config import gguf_config, open_reader

logger = logging.getLogger(__name__)

# Raised whenever what is written here changes: folders made by older code are then made again.
FOLDER_FORMAT = 1
# Under the model cache (tandem/checkpoints/cache.py).
FOLDERS_DIR = "gguf"


def prepared_folder(gguf_file: str | os.PathLike[str], cache_root: Path) -> Path:
    """The folder for `gguf_file` under `cache_root`, made if it is not there yet."""
    file = Path(gguf_file).resolve()
    if not file.is_file():
        raise ValueError(f"GGUF file {str(gguf_file)!r} does not exist")
    st = file.stat()
    key = hashlib.sha256(f"{FOLDER_FORMAT}|{file}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root / FOLDERS_DIR / f"{file.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    info = gguf_config(open_reader(file))
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        config = {**info.config, GGUF_CONFIG_KEY: {"file": str(file), "size": st.st_size}}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(info.generation_config, indent=2))
        if info.has_tokenizer:
            logger.info("%s: building its tokenizer from the file's metadata (once)", file.name)
            _write_tokenizer(file, tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()


def _write_tokenizer(file: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as exc:  # the converters raise many types for metadata they cannot read
        raise ValueError(
            f"cannot build a tokenizer from {file.name}'s metadata ({type(exc).__name__}: {exc}); "
            "pass a tokenizer folder (tokenizer=... / --tokenizer)"
        ) from exc
    tok.save_pretrained(str(out))
