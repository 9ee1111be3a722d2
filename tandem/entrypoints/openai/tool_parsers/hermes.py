"""Hermes-style calls (NousResearch Hermes 2 Pro / 3, Qwen2.5, Qwen3): each call its own block,
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number per message, with
content before, between and after. Some of these tokenizers make `<tool_call>` a special token, so
special tokens are kept in the text."""

from tandem.entrypoints.openai.tool_parsers.base import CallFormat, ToolParser

PARSER = ToolParser(
    "hermes", CallFormat(markers=("<tool_call>",), close="</tool_call>"), keep_special_tokens=True
)
