"""Checkpoints shipped inside the package: the embedded default model (`default/`) and its draft
(`default-draft/`), trained by tools/train_default_model.py. The model code is in `tandem.model`."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "default"


def default_model_path() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(
            "no model given and the embedded default model is not installed in this build; "
            "pass a checkpoint folder (model=PATH / --model PATH)"
        )
    return str(DEFAULT_MODEL_DIR)
