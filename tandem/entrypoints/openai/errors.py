"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import json
from typing import Any

# Statuses and the OpenAI error type each reports.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # A message may quote client input; a lone surrogate in it could not be sent as UTF-8.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(exc: Exception | str, param: str | None = None) -> OpenAIError:
    """A 400 from a ValueError; the param is the field the message names, when it names one."""
    message = str(exc)
    if param is None:
        param = _param_of(message)
    # "SamplingParams.top_p must be ..." reads as "top_p must be ..." to an API client.
    return OpenAIError(400, message.removeprefix("SamplingParams."), param=param)


_KNOWN_PARAMS = (
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "seed",
    "stop_token_ids",
    "stop",
    "n",
    "priority",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "best_of",
    "suffix",
)


def _param_of(message: str) -> str | None:
    if message.startswith("SamplingParams."):
        return message.split()[0].removeprefix("SamplingParams.")
    lowered = message.lower()
    if "prompt" in lowered and "max_tokens" in lowered:
        return "max_tokens"
    for name in _KNOWN_PARAMS:
        if lowered.startswith(name + " ") or lowered.startswith(name + ":"):
            return name
    if "prompt" in lowered:
        return "prompt"
    return None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: Any) -> str | None:
    """'messages[0].content' from pydantic's ('body', 'messages', 0, 'content', 'str'): union tags dropped."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        part = str(part)
        if "[" in part or part in _TYPE_TAGS or part[:1].isupper() or "-" in part:
            break  # a union member's tag, not a field
        path += f".{part}" if path else part
    return path or None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """Turn FastAPI/pydantic validation errors (their 422) into one 400 naming the first bad field."""
    if not errors:
        return OpenAIError(400, "invalid request")
    first = errors[0]
    param = _param_path(first.get("loc", ()))
    same = [e for e in errors if _param_path(e.get("loc", ())) == param]
    kind = first.get("type", "")
    if kind == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif kind == "missing":
        message = f"missing required field {param!r}"
    elif len(same) > 1:  # every member of a union failed
        message = f"{param}: {first.get('msg', 'invalid value')} (or any other allowed type)"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    others = len(errors) - len(same)
    if others:
        message += f"; and {others} more problem(s)"
    return OpenAIError(400, message, param=param)
