"""`--tool-call-parser` choices: one file per model family's format, all read by `base.CallReader`."""

from tandem.entrypoints.openai.tool_parsers import hermes, llama3_json, mistral
from tandem.entrypoints.openai.tool_parsers.base import ToolParser

TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": hermes.PARSER,
    "llama3_json": llama3_json.PARSER,
    "mistral": mistral.PARSER,
    # Qwen2.5 and Qwen3 write Hermes' format.
    "qwen": hermes.PARSER,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None
