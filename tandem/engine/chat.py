"""Chat messages as chat templates take them, for the offline `LLM.chat()` and the HTTP chat route
alike (both then render with `Tokenizer.apply_chat_template`)."""

from __future__ import annotations

import json
from typing import Any


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: an assistant's tool call arguments as objects (OpenAI
    sends them as JSON text; templates such as Qwen's and Llama's write them with `tojson`)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = None
            if isinstance(args, dict):
                call = {**call, "function": {**fn, "arguments": args}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def text_content(content: Any, where: str) -> str:
    """A message's content as one string: text parts (`{"type": "text", "text": ...}`) joined, as
    the HTTP route flattens them; no content is the empty string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            is_text = isinstance(part, dict) and part.get("type", "text") == "text"
            if not is_text or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"{where}.content: only text parts are taken (text-only models), got {kind!r}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}"
    )


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style message dicts as the chat template takes them: content flattened to a string,
    tool call arguments as objects."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    return [
        template_message({**m, "content": text_content(m.get("content"), f"messages[{i}]")})
        for i, m in enumerate(messages)
    ]


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` as the template takes them: OpenAI-style tool definitions (dicts), or None."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(
            "tools must be a list of tool definitions such as "
            '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
        )
    return tools
