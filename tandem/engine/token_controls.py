"""The front end's half of the token-level sampling controls: bad_words to token sequences, and
the checks of token ids against the vocabulary (the sampler applies them, tandem/worker/sampler.py)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.sampling_params import SamplingParams


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word's token sequences, as vLLM forms them: the word as written (stripped of leading
    spaces) and, where the tokenizer folds a leading space into the first token, " word" too, so
    the word is blocked at the start of the text and after a space alike."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if plain:
            out.append(plain)
        spaced = encode(" " + word.lstrip())
        # Only a distinct tokenization of the same length: a lone space token followed by the
        # plain word would block every space after a matching prefix.
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def resolve(params: SamplingParams, encode: Callable[[str], list[int]], vocab_size: int) -> SamplingParams:
    """`params` with bad_words tokenized; ValueError naming the field for a token id outside the
    vocabulary."""
    if params.logit_bias:
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"allowed_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
    return tokenize_bad_words(params, encode)


def tokenize_bad_words(params: SamplingParams, encode: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with bad_words tokenized (itself when it has none, or has them tokenized already:
    the server does this once for all of a request's prompts, off its event loop)."""
    if params.bad_words and params.bad_words_token_ids is None:
        return params.clone(bad_words_token_ids=bad_words_token_ids(params.bad_words, encode))
    return params
