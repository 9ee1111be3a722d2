"""Tandem's model cache: where `tandem pull` puts models and GGUF files' prepared folders go.

$TANDEM_MODEL_CACHE if set, else $XDG_CACHE_HOME/tandem/models (~/.cache/tandem/models). A pulled
model is <cache>/<name>/<file> with <cache>/<name>/pulled.json recording where it came from;
folders prepared from GGUF files (tandem/model/gguf_folder.py) are under <cache>/gguf/.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tandem.checkpoints.registry import PullableModel

MODEL_CACHE_ENV = "TANDEM_MODEL_CACHE"
RECORD_FILE = "pulled.json"


def model_cache_dir() -> Path:
    forced = os.environ.get(MODEL_CACHE_ENV, "").strip()
    if forced:
        return Path(forced).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "tandem" / "models"


def pulled_path(entry: PullableModel, root: Path) -> Path:
    return root / entry.name / entry.file_name


def record_path(entry: PullableModel, root: Path) -> Path:
    return root / entry.name / RECORD_FILE


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str
    path: Path
    size: int
    # Pulled and checked against this registry entry (its sha256 recorded at pull time).
    verified: bool


def cached_model(entry: PullableModel, root: Path) -> CachedModel | None:
    """The entry's pulled file, or None when it is not in the cache."""
    path = pulled_path(entry, root)
    if not path.is_file():
        return None
    size = path.stat().st_size
    try:
        record = json.loads(record_path(entry, root).read_text())
    except (OSError, ValueError):
        record = {}
    verified = size == entry.size and record.get("sha256") == entry.sha256 and record.get("size") == size
    return CachedModel(entry.name, path, size, verified)
