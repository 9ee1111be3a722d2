"""Tokenizer loading (Hugging Face fast tokenizers) and chat templates."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, cast


class Tokenizer:
    """A thin wrapper over a `transformers` fast tokenizer loaded from a local folder."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad folder
            raise ValueError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        if not getattr(self.hf, "is_fast", False):
            raise ValueError(f"the tokenizer in {path!r} is not a fast (tokenizer.json) tokenizer")
        self.backend = self.hf.backend_tokenizer
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (an upper bound): the longest
        vocabulary entry or added token, as written in the vocabulary (a byte-level or metaspace
        entry is at least as long as the text it decodes to)."""
        return max(1, max(len(t) for t in self.backend.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, UnicodeError) as exc:  # lone surrogates cannot be encoded as UTF-8
            check_text(text, "the prompt")
            raise ValueError(f"cannot tokenize the prompt: {exc}") from exc

    # transformers types decode() as `str | list[str]` (the list for batched input); one sequence of
    # ids decodes to one string.
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def decode_token(self, token_id: int) -> str:
        return cast(str, self.hf.decode([token_id], skip_special_tokens=False))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's prompt ids. `continue_final_message` leaves the last (assistant)
        message open for the model to go on with; `template_kwargs` are extra variables for the
        template (vLLM's chat_template_kwargs, e.g. enable_thinking)."""
        if chat_template is None and not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
        try:
            text = self.hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=cast("list[Any] | None", tools),
                continue_final_message=continue_final_message,
                **extra,
            )
        except Exception as exc:  # jinja errors, missing keys
            raise ValueError(f"cannot apply the chat template: {exc}") from exc
        if not isinstance(text, str):  # tokenize=False renders one conversation to one string
            raise ValueError(f"the chat template rendered {type(text).__name__}, not text")
        # The template already holds the special tokens (BOS and role markers).
        return self.encode(text, add_special_tokens=False)


# apply_chat_template's own arguments: chat_template_kwargs may not pass them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_text(text: str, what: str) -> None:
    """Raise ValueError if `text` is not valid Unicode (a lone surrogate, which UTF-8 cannot hold)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate {text[exc.start]!r} at position {exc.start}"
        ) from None


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's path, or the Jinja template itself (as vLLM takes it)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the chat template {value!r}: {exc}") from exc
    if "{" in value or "\n" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
