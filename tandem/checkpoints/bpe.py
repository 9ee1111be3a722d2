"""Byte-level BPE tokenizers trained on local text, for test checkpoints, benchmarks and the default model."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out: Path,
    special_tokens: tuple[str, ...] | list[str] = SPECIAL_TOKENS,
    chat_template: str | None = None,
) -> Any:
    """Train a GPT-2-style byte-level BPE (`<s>`/`</s>`/`<unk>` as bos/eos/unk) and save it as a
    `PreTrainedTokenizerFast` in `out`; returns that tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    return fast
