"""The JSON schemas tool_choice "required" and named functions constrain the output with, checked
with jsonschema against valid and invalid calls; and the request-side plan (which mode, 400s)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.engine.chat import template_message
from tandem.entrypoints.openai.protocol import ChatCompletionRequest
from tandem.entrypoints.openai.tool_calls import REQUIRED, plan_tools, tool_choice_schema
from tandem.sampling_params import SamplingParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/num"}, "b": {"$ref": "#/$defs/num"}},
            "required": ["a", "b"],
            "$defs": {"num": {"type": "number"}},
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD, NO_ARGS]


def valid(schema: dict, value) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def call(name: str, params) -> dict:
    return {"name": name, "parameters": params}


def test_required_schema_accepts_calls_of_the_tools():
    schema = tool_choice_schema(TOOLS, "required", parallel=True)
    assert valid(schema, [call("get_weather", {"city": "Paris"})])
    assert valid(schema, [call("add", {"a": 1, "b": 2.5}), call("now", {}), call("get_weather", {"city": "x", "unit": "F"})])


@pytest.mark.parametrize(
    "value",
    [
        [],  # at least one call
        {"name": "now", "parameters": {}},  # an array
        [call("delete_everything", {})],  # not a tool
        [call("get_weather", {})],  # a required argument missing
        [call("get_weather", {"city": "Paris", "unit": "K"})],  # not in the enum
        [call("get_weather", {"city": "Paris", "extra": 1})],  # the tool allows no other keys
        [call("add", {"a": "1", "b": 2})],  # $ref to the hoisted definition: a number
        [{"name": "now"}],  # parameters missing
        [{"name": "now", "parameters": {}, "arguments": {}}],  # no other keys in a call
        [call("get_weather", {"city": "Paris"}) | {"name": "add"}],  # the name picks the schema
    ],
)
def test_required_schema_rejects_what_is_not_a_call(value):
    assert not valid(tool_choice_schema(TOOLS, "required", parallel=True), value)


def test_required_without_parallel_calls_allows_one():
    schema = tool_choice_schema(TOOLS, "required", parallel=False)
    assert valid(schema, [call("now", {})])
    assert not valid(schema, [call("now", {}), call("now", {})])
    assert valid(tool_choice_schema(TOOLS, "required", parallel=True), [call("now", {}), call("now", {})])


def test_named_schema_is_the_functions_parameters():
    named = {"type": "function", "function": {"name": "add"}}
    schema = tool_choice_schema(TOOLS, named, parallel=True)
    assert valid(schema, {"a": 1, "b": 2})
    assert not valid(schema, {"a": 1})
    assert not valid(schema, [call("add", {"a": 1, "b": 2})])
    assert valid(tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "now"}}, True), {})
    with pytest.raises(ValueError, match="'nope'"):
        tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)


def test_conflicting_definitions_are_refused():
    other = json.loads(json.dumps(ADD))
    other["function"]["name"] = "add2"
    other["function"]["parameters"]["$defs"]["num"] = {"type": "string"}
    with pytest.raises(ValueError, match="num"):
        tool_choice_schema([ADD, other], "required", True)
    same = json.loads(json.dumps(ADD))
    same["function"]["name"] = "add2"
    assert valid(tool_choice_schema([ADD, same], "required", True), [call("add2", {"a": 1, "b": 2})])


def test_output_under_the_required_schema_parses_to_its_calls():
    """What the constrained model writes (any valid JSON formatting) reads back as the calls."""
    calls = [call("add", {"a": 1, "b": 2}), call("get_weather", {"city": "Zürich"})]
    schema = tool_choice_schema(TOOLS, "required", True)
    for text in (json.dumps(calls), json.dumps(calls, indent=2, ensure_ascii=False), json.dumps(calls, separators=(",", ":"))):
        assert valid(schema, json.loads(text))
        parsed = REQUIRED.parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(c["name"], c["parameters"]) for c in calls]


def plan(**kw):
    return plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw), "hermes")


def test_plans():
    assert plan().mode == "none" and plan().tools is None
    assert plan(tools=[WEATHER]).mode == "auto"  # OpenAI's default with tools
    p = plan(tools=[WEATHER], tool_choice="none")
    assert p.mode == "none" and p.tools == [WEATHER]  # the template still sees them
    p = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert p.mode == "required" and p.schema == tool_choice_schema(TOOLS, "required", False)
    p = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert p.mode == "named" and p.named == "add"


def test_auto_keeps_special_tokens_where_the_format_is_made_of_them():
    for choice, keep in (("auto", True), ("none", False)):
        params = SamplingParams()
        plan(tools=[WEATHER], tool_choice=choice).apply(params)  # the server's parser: hermes
        assert params.skip_special_tokens is not keep


def test_template_gets_arguments_as_objects():
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}},
        {"id": "d", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]}
    out = template_message(msg)
    assert out["tool_calls"][0]["function"]["arguments"] == {"x": [1]}
    assert out["tool_calls"][1]["function"]["arguments"] == "not json"
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"x": [1]}'  # not changed in place
