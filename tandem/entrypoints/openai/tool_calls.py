"""Tool calling in chat: which tools the chat template sees, which text the model must write, and
how its text becomes `tool_calls` (whole, or streamed as OpenAI streams them).

`tool_choice`:
- "none": the template still sees the tools; the output is content.
- "auto" (the default when tools are given): the model decides; its text is read by the server's
  `--tool-call-parser` (only with `--enable-auto-tool-choice`, else 400, as vLLM).
- "required" / a named function: the output is constrained by a JSON schema (`tool_choice_schema`),
  so it always parses: a JSON array of `{"name", "parameters"}` calls, or the named function's
  arguments object; read as such whatever the parser flag.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from tandem.entrypoints.openai.errors import bad_request
from tandem.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from tandem.entrypoints.openai.tool_parsers import get_tool_parser
from tandem.entrypoints.openai.tool_parsers.base import (
    CallFormat,
    Delta,
    Parsed,
    ParsedCall,
    ToolCallDelta,
    ToolParser,
    call_id,
)
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

# The output under tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`.
REQUIRED = ToolParser("required", CallFormat(markers=("[",), separator=",", close="]", at_start_only=True))

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def _named(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return str(tool_choice["function"]["name"])
    return None


def tool_choice_schema(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool) -> dict[str, Any]:
    """The JSON schema the model's whole output must match under tool_choice "required" or a named
    function (`{"type": "function", "function": {"name": ...}}`), for OpenAI-style `tools`.

    Named: that function's parameters schema (the output is its arguments object). Required: an
    array of one or more calls, each `{"name": <a tool's name>, "parameters": <that tool's
    parameters>}` (at most one without parallel calls). Each tool's `$defs` / `definitions` move to
    the root, where its `#/$defs/...` references then point.
    """
    name = _named(tool_choice)
    if name is not None:
        for tool in tools:
            if _function(tool)["name"] == name:
                return copy.deepcopy(_function(tool).get("parameters") or _NO_PARAMETERS)
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} has no schema (only 'required' and named functions)")
    defs: dict[str, dict[str, Any]] = {}
    items = []
    for tool in tools:
        fn = _function(tool)
        params = copy.deepcopy(fn.get("parameters") or _NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            found = params.pop(key, None) or {}
            if not isinstance(found, dict):
                raise ValueError(f"the parameters of {fn['name']!r}: {key} must be an object")
            for def_name, body in found.items():
                if defs.setdefault(key, {}).setdefault(def_name, body) != body:
                    raise ValueError(
                        f"tools define {key}/{def_name} differently; give each definition one name"
                    )
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def constrain(params: SamplingParams, schema: dict[str, Any]) -> None:
    """Make the sampler keep the output inside `schema` (structured output), so the call parses."""
    if params.structured_outputs is not None:
        raise ValueError(
            'tool_choice "required" or a named function constrains the output already; it cannot be '
            "combined with response_format, structured_outputs or guided_* fields"
        )
    params.structured_outputs = StructuredOutputsParams(json=schema)


class NamedReader:
    """The output under a named tool_choice: the whole text is the function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[ParsedCall] = []
        self.broken = False
        self.parts: list[str] = []  # the arguments so far (joined into the call's at the finish)

    def append(self, piece: str) -> Delta:
        """Read the text's next piece."""
        out = Delta()
        if not piece:
            return out
        if not self.calls:
            self.calls.append(ParsedCall(call_id(), self.name, ""))
            out.add_call(ToolCallDelta(0, "", self.calls[0].id, self.name))
        self.parts.append(piece)
        out.add_call(ToolCallDelta(0, piece))
        return out

    def finish(self) -> Delta:
        out = Delta()
        if not self.calls:  # nothing written: the call, with empty arguments
            self.calls.append(ParsedCall(call_id(), self.name, ""))
            out.add_call(ToolCallDelta(0, "", self.calls[0].id, self.name))
        self.calls[0].arguments = "".join(self.parts)
        return out


@dataclass
class ToolPlan:
    """One chat request's tool handling."""

    mode: str  # "none", "auto", "required", "named"
    tools: list[dict[str, Any]] | None  # what the chat template sees
    parser: ToolParser | None = None
    named: str | None = None
    parallel: bool = True
    schema: dict[str, Any] | None = None

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"

    def apply(self, params: SamplingParams) -> None:
        """Set what the output needs on the request's sampling parameters (400 if unsupported)."""
        if self.parser is not None and self.mode == "auto" and self.parser.keep_special_tokens:
            params.skip_special_tokens = False
        if self.schema is not None:
            try:
                constrain(params, self.schema)
            except ValueError as exc:
                raise bad_request(str(exc), "tool_choice") from exc

    def reader(self) -> ChoiceTools:
        return ChoiceTools(self)

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and tool calls of a whole output."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCall(id=call_id(), function=FunctionCall(name=self.named, arguments=text))]
        assert self.parser is not None
        parsed: Parsed = self.parser.parse(text)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        content = parsed.content if self.mode == "auto" else None
        if self.mode == "required" and not calls:  # cut short by max_tokens: keep the text
            content = text
        return content, [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        if called and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


class ChoiceTools:
    """One streamed choice's tool calls: append each new piece of text, get (content, call deltas)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        if plan.mode == "named":
            assert plan.named is not None
            self.reader: Any = NamedReader(plan.named)
        else:
            assert plan.parser is not None
            self.reader = plan.parser.reader()

    @property
    def called(self) -> bool:
        return bool(self.reader.calls)

    def append(self, piece: str) -> tuple[str, list[DeltaToolCall]]:
        return self._convert(self.reader.append(piece))

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        return self._convert(self.reader.finish())

    def _convert(self, delta: Delta) -> tuple[str, list[DeltaToolCall]]:
        calls = []
        for piece in delta.calls:
            if piece.index > 0 and not self.plan.parallel:
                continue
            if piece.id is not None:
                fn = DeltaFunctionCall(name=piece.name, arguments=piece.arguments)
                calls.append(DeltaToolCall(index=piece.index, id=piece.id, type="function", function=fn))
            elif piece.arguments:
                calls.append(DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments)))
        content = delta.content if self.plan.mode == "auto" else ""
        return content, calls


def plan_tools(body: ChatCompletionRequest, tool_parser: str | None) -> ToolPlan:
    """The request's tool handling; 400 for a tool_choice the request or server cannot have.
    `tool_parser`: the server's parser name under --enable-auto-tool-choice, else None."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if tools is None:
        if choice != "none":
            raise bad_request("tool_choice other than 'none' needs tools", "tool_choice")
        return ToolPlan("none", None)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have different function names", "tools")
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if tool_parser is None:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        return ToolPlan("auto", tools, get_tool_parser(tool_parser), parallel=parallel)
    raw: str | dict[str, Any] = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    try:
        schema = tool_choice_schema(tools, raw, parallel)
    except ValueError as exc:
        raise bad_request(exc, "tool_choice" if isinstance(choice, NamedToolChoice) else "tools") from exc
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", tools, named=choice.function.name, parallel=parallel, schema=schema)
    return ToolPlan("required", tools, REQUIRED, parallel=parallel, schema=schema)
