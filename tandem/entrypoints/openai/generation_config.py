"""--generation-config: the sampling defaults a checkpoint's generation_config.json sets, as vLLM
reads them (fields a request leaves unset take these values)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json's names -> the request fields they give defaults to.
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(setting: str, model_dir: str) -> dict[str, Any]:
    """`auto`: the model folder's generation_config.json; `vllm`: none (the API's own defaults);
    anything else: a folder holding a generation_config.json. A missing file gives no defaults;
    an unreadable one is a ValueError."""
    if setting == "vllm":
        return {}
    folder = Path(model_dir if setting == "auto" else setting)
    if setting != "auto" and not folder.is_dir():
        raise ValueError(f"--generation-config: {setting!r} is neither auto, vllm nor a folder")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    out = {}
    for name, field in FIELDS.items():
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = value
    return out
