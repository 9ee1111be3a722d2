"""A request's structured-output fields, in any of the spellings clients send, as one
`StructuredOutputsParams`: OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` body field and its older `guided_*` fields."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from tandem.engine.processor import InputProcessor
from tandem.entrypoints.openai.errors import OpenAIError, bad_request
from tandem.entrypoints.openai.protocol import SamplingFields
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # OpenAI: no schema means any JSON object
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return StructuredOutputsParams(json=schema)
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format"
    )


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, checked (a 400 naming the field the client used if it is malformed
    or does not compile), or None."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    try:
        if body.response_format is not None:
            sp = _from_response_format(body.response_format)
            if sp is not None:
                found.append(("response_format", sp))
        if body.structured_outputs is not None:
            fields = dict(body.structured_outputs)
            # vLLM's spelling of the JSON-object constraint; `disable_*`/`whitespace_pattern` and the
            # like are vLLM backend options with no meaning here.
            fields = {k: v for k, v in fields.items() if k in ("json", "regex", "choice", "grammar", "json_object")}
            found.append(("structured_outputs", StructuredOutputsParams(**fields)))
        for name, kind in _GUIDED.items():
            value = getattr(body, name)
            if value is not None:
                found.append((name, StructuredOutputsParams(**{kind: value})))
    except OpenAIError:
        raise
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc).replace("structured_outputs", _field_of(body)), _field_of(body)) from None
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"set at most one structured output field, got {names}", found[1][0])
    return found[0][1]


async def check_constraint(
    executor: Executor, inputs: InputProcessor, params: SamplingParams, body: SamplingFields
) -> None:
    """Compile the request's constraint in a check process (tandem/structured/checker.py), off the
    event loop: a 400 naming the field the client used if it does not compile."""
    sp = params.structured_outputs
    if sp is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(executor, inputs.checker.check, sp)
    except ValueError as exc:
        name = _field_of(body)
        message = str(exc)
        if name != "structured_outputs":
            message = f"{name}: {message}"
        raise bad_request(message, name) from None


def _field_of(body: SamplingFields) -> str:
    if body.structured_outputs is not None:
        return "structured_outputs"
    for name in _GUIDED:
        if getattr(body, name) is not None:
            return name
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        return "response_format"
    return "tools"  # tool_choice "required" or a named function: the tools' parameter schemas
