"""Llama 3.1 / 3.2 / 3.3 JSON calls: the message is `{"name": "f", "parameters": {...}}`, after
`<|python_tag|>` or not, several separated by `;`. Only a message that opens with a call holds
calls (a reply that merely contains JSON later on is content)."""

from tandem.entrypoints.openai.tool_parsers.base import CallFormat, ToolParser

PARSER = ToolParser(
    "llama3_json",
    CallFormat(markers=("<|python_tag|>", "{"), separator=";", keep_marker=True, at_start_only=True),
)
