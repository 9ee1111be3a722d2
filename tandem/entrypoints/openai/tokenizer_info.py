"""GET /tokenizer_info: the served tokenizer's configuration, as vLLM's endpoint of that name gives
it (lm-eval's `local-completions` reads it to use the server's tokenizer through /tokenize)."""

from __future__ import annotations

from typing import Any

from tandem.engine.tokenizer import Tokenizer

# Where the tokenizer was loaded from and how: no filesystem path leaves the server.
_DROPPED = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only")


def _plain(value: Any) -> Any:
    """JSON-ready: special tokens (AddedToken) become their text, containers are walked."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer's init config (special tokens, `model_max_length`, added tokens...), its class
    name as `tokenizer_class`, and its chat template where it has one."""
    hf = tokenizer.hf
    config = {k: _plain(v) for k, v in (getattr(hf, "init_kwargs", None) or {}).items() if k not in _DROPPED}
    for name, token in hf.special_tokens_map.items():
        if isinstance(token, str):
            config.setdefault(name, token)
    config["tokenizer_class"] = type(hf).__name__
    if hf.chat_template:
        config["chat_template"] = hf.chat_template
    return config
