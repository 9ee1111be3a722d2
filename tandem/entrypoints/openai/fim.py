"""Fill-in-the-middle prompts for completions' `suffix`: prefix-suffix-middle order, in whichever
FIM token spelling the tokenizer's vocabulary holds."""

from __future__ import annotations

from collections.abc import Callable

# (prefix, suffix, middle) tokens: StarCoder/SantaCoder, Qwen2.5-Coder, DeepSeek-Coder.
FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_token_ids(token_to_id: Callable[[str], int | None]) -> tuple[int, int, int] | None:
    """The ids of the first FIM spelling the vocabulary holds whole, or None."""
    for names in FIM_SPELLINGS:
        pre, suf, mid = (token_to_id(n) for n in names)
        if pre is not None and suf is not None and mid is not None:
            return pre, suf, mid
    return None


def fim_prompt(
    token_to_id: Callable[[str], int | None], encode: Callable[[str], list[int]], prefix: str, suffix: str
) -> list[int]:
    """<prefix> PREFIX <suffix> SUFFIX <middle>, as token ids; ValueError when the model has no FIM
    tokens (it was not trained to fill in a middle, so a suffix cannot be honoured)."""
    ids = fim_token_ids(token_to_id)
    if ids is None:
        known = ", ".join("/".join(names) for names in FIM_SPELLINGS)
        raise ValueError(
            f"suffix needs a fill-in-the-middle model: this model's tokenizer has none of the FIM tokens ({known})"
        )
    pre, suf, mid = ids
    return [pre, *encode(prefix), suf, *encode(suffix), mid]
