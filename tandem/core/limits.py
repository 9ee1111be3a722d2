"""What a request must satisfy to be accepted, checked before it is queued (here or in another process)."""

from __future__ import annotations

from dataclasses import dataclass

# The longest `cache_salt` accepted, in characters. Every request carries its salt, and a salt's
# prefix-cache tree is keyed by it while the tree holds blocks: the bound keeps what one client can
# make the engine hold per request and per cached salt small (a salt is an identifier, not data).
MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(salt: str | None) -> None:
    """Raise ValueError naming `cache_salt` for one longer than MAX_CACHE_SALT_CHARS."""
    if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt is {len(salt)} characters long; at most {MAX_CACHE_SALT_CHARS} are accepted"
        )


def check_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    n: int,
    *,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
) -> None:
    """Raise ValueError for a request that could never run."""
    total = num_prompt_tokens + max_tokens
    if num_prompt_tokens < 1:
        raise ValueError("the prompt must contain at least one token")
    if total > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
            f"beyond max_model_len ({max_model_len})"
        )
    blocks = -(-total // block_size)
    if blocks > num_blocks:
        raise ValueError(
            f"prompt plus max_tokens ({total} tokens) needs {blocks} KV blocks, "
            f"more than the whole KV cache ({num_blocks} blocks of {block_size})"
        )
    if n > max_num_seqs:
        raise ValueError(f"n ({n}) exceeds max_num_seqs ({max_num_seqs})")


@dataclass(frozen=True, slots=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    # The ids that end a sample (the model's and its tokenizer's), as the engine holds them.
    eos_token_ids: tuple[int, ...] = ()

    def max_tokens_for(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Resolve `max_tokens=None` (as much as fits) and check the request could ever run."""
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
            if max_tokens < 1:
                raise ValueError(
                    f"the prompt ({num_prompt_tokens} tokens) leaves no room to generate within "
                    f"max_model_len ({self.max_model_len})"
                )
        return max_tokens

    def check(self, prompt_token_ids: list[int], max_tokens: int, n: int, stop_token_ids: list[int]) -> None:
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        check_fits(
            len(prompt_token_ids),
            max_tokens,
            n,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
        )
