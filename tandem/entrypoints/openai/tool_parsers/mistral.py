"""Mistral calls (Mistral 7B Instruct v0.3, Mixtral 8x22B, Mistral Small/Nemo with tokenizer v3
and v7): `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`. `[TOOL_CALLS]` is a special
token, so it is kept in the text; Mistral's chat templates want call ids of 9 letters and digits."""

import random
import string

from tandem.entrypoints.openai.tool_parsers.base import CallFormat, ToolParser

_ID_CHARS = string.ascii_letters + string.digits


def mistral_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


PARSER = ToolParser(
    "mistral",
    CallFormat(markers=("[TOOL_CALLS]",), open="[", separator=",", close="]", make_id=mistral_id),
    keep_special_tokens=True,
)
