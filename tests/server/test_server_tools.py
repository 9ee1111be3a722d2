"""Tool calling against `tandem serve` (a subprocess) with the real openai SDK: a tool
conversation rendered by a Hermes-style `--chat-template`, tool_choice "auto" answered as the
model's text reads, and the two-turn tool loop under "required" / a named function (structured
output constrains the model, so the call parses)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_utils import FAST_ARGS, RemoteServer

from tandem.engine.chat import template_message
from tandem.engine.tokenizer import Tokenizer
from tandem.entrypoints.openai.tool_parsers import get_tool_parser

MODEL = "tiny"
TEMPLATE = Path(__file__).parent / "hermes_tool_template.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def server(llama_dir):
    args = ["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with RemoteServer(llama_dir, *FAST_ARGS, "--served-model-name", MODEL, *args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_a_tool_conversation_renders_through_the_chat_template(server, llama_dir):
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    with server.http() as http:
        r = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": [WEATHER]})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        text = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    tok = Tokenizer(str(llama_dir))
    convo = [template_message({**m, "content": m["content"] or ""}) for m in messages]
    assert ids == tok.apply_chat_template(convo, True, TEMPLATE.read_text(), [WEATHER])
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert '<tool_response id="call_1">\n22 C\n</tool_response>' in text
    assert text.endswith("<|assistant|>\n")


def accumulated(client, **kw):
    """A streamed chat completion as the SDK's stream state accumulates it (the `.stream()` helper's
    accumulation, without its refusal to finish a completion cut by max_tokens)."""
    state = ChatCompletionStreamState(input_tools=kw.get("tools", []))
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def test_auto_answers_as_the_model_text_reads(server, client):
    """The tiny model's greedy text under the tool prompt, read by the hermes parser, is what chat
    answers, streamed and not."""
    with server.http() as http:
        ids = http.post("/tokenize", json={"model": MODEL, "messages": QUESTION, "tools": [WEATHER]}).json()["tokens"]
    # The hermes parser keeps special tokens in the text (<tool_call> is one in some tokenizers).
    raw = client.completions.create(model=MODEL, prompt=ids, **GREEDY, extra_body={"skip_special_tokens": False}).choices[0]
    expected = get_tool_parser("hermes").parse(raw.text)
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], **GREEDY)
    (choice,) = out.choices
    assert choice.message.content == expected.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
        (c.name, c.arguments) for c in expected.calls
    ]
    assert choice.finish_reason == ("tool_calls" if expected.calls and raw.finish_reason == "stop" else raw.finish_reason)
    final = accumulated(client, model=MODEL, messages=QUESTION, tools=[WEATHER], **GREEDY)
    assert final.choices[0].message.content == choice.message.content
    assert final.choices[0].finish_reason == choice.finish_reason
    assert not final.choices[0].message.tool_calls


def test_required_cannot_be_combined_with_another_constraint(client):
    with pytest.raises(openai.BadRequestError, match="response_format") as err:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
            **GREEDY,
        )
    assert err.value.body["param"] == "tool_choice"


def get_weather(city: str, unit: str) -> str:
    return f"22 {unit} in {city}"


def tool_loop(client, tool_choice, stream: bool) -> None:
    """Turn 1: the model must call the tool; the client runs it and sends the result; turn 2: the
    model answers in text."""
    kw = dict(model=MODEL, tools=[WEATHER], temperature=0.0, max_tokens=64)
    if stream:
        first = accumulated(client, messages=QUESTION, tool_choice=tool_choice, **kw)
    else:
        first = client.chat.completions.create(messages=QUESTION, tool_choice=tool_choice, **kw)
    message = first.choices[0].message
    assert message.tool_calls, first
    results = []
    for call in message.tool_calls:
        assert call.function.name == "get_weather" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        results.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**args)})
    assistant = {
        "role": "assistant",
        "content": message.content,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ],
    }
    messages = [*QUESTION, assistant, *results]
    if stream:
        second = accumulated(client, messages=messages, tool_choice="none", **kw)
    else:
        second = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
    answer = second.choices[0]
    assert not answer.message.tool_calls and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_two_turn_tool_loop(client, tool_choice, stream):
    tool_loop(client, tool_choice, stream)
