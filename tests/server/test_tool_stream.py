"""Tool calling through the HTTP layer, in-process: the real app and the real openai SDK (over an
ASGI transport), with an engine whose output is scripted (a random-weight model writes no tool
calls). The streamed chunks must accumulate, by the SDK's own stream helper, to the non-streamed
response; each call's first delta names it (index, id, type, name), its arguments follow in
fragments; finish_reason "tool_calls"."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from server_utils import httpx

from tandem.core.limits import EngineLimits
from tandem.engine.core_client import AsyncEngineClient, RequestStream
from tandem.engine.processor import InputProcessor
from tandem.engine.tokenizer import Tokenizer, load_chat_template
from tandem.entrypoints.openai import tool_calls
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.serving import ServerState
from tandem.entrypoints.openai.tenants import Tenants
from tandem.outputs import CompletionOutput, RequestOutput

TEMPLATE = Path(__file__).parent / "hermes_tool_template.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
]
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
SCRIPTS = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "CET"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"tz": "CET"}}]',
}
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]


class NoConnection:
    def send(self, payload: bytes) -> None:
        raise AssertionError("nothing may reach an engine process")


class ScriptedEngine(AsyncEngineClient):
    """The real client's front half (tokenizer, input checks, streams); each request's output is
    the next scripted text, given out a few characters at a time."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(config=None, connections=[NoConnection()])  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self.limits = EngineLimits(512, 1024, 16, 64, 8)
        self.inputs = InputProcessor(tokenizer, self.limits)
        self.script: list[str] = []
        self.prompts: list[str] = []

    def add(self, req, text, notify, on_finish=None) -> RequestStream:
        stream = RequestStream(req.request_id, notify, on_finish)
        self.prompts.append(self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False))
        out = self.script.pop(0)
        asyncio.get_running_loop().create_task(self._play(stream, req, out))
        return stream

    async def _play(self, stream: RequestStream, req, text: str) -> None:
        # The last output adds no text, as when the model's last token is EOS.
        cuts = [*list(range(5, len(text), 7)), len(text), len(text)]
        for i, cut in enumerate(cuts):
            done = i == len(cuts) - 1
            c = CompletionOutput(0, text[:cut], list(range(cut)), finish_reason="stop" if done else None)
            stream.put(RequestOutput(req.request_id, None, req.prompt_token_ids, [c], finished=done))
            await asyncio.sleep(0.001)

    def abort(self, request_ids: list[str]) -> None:
        pass


@pytest.fixture
def server(tokenizer_dir):
    engine = ScriptedEngine(Tokenizer(str(tokenizer_dir)))
    state = ServerState(
        model_name="m",
        metrics=ServerMetrics("m"),
        tenants=Tenants(),
        max_waiting_requests=8,
        drain_timeout=1.0,
        client=engine,
        chat_template=load_chat_template(str(TEMPLATE)),
        tool_parser="hermes",
    )
    return state, engine, build_app(state, None)


def run(app, scenario):
    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        async with http:
            return await scenario(client)

    return asyncio.run(main())


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


async def three_ways(client, engine, text: str, **kw):
    """The same scripted output non-streamed, through the SDK's stream helper, and as raw chunks."""
    engine.script += [text, text, text]
    whole = await client.chat.completions.create(model="m", messages=MESSAGES, **kw)
    async with client.chat.completions.stream(model="m", messages=MESSAGES, **kw) as stream:
        final = await stream.get_final_completion()
    chunks = [c async for c in await client.chat.completions.create(model="m", messages=MESSAGES, stream=True, **kw)]
    return whole, final, chunks


def check_deltas(chunks, n_calls: int) -> None:
    """OpenAI's shape: a call's first delta has index, id, type and name; later ones only arguments,
    which arrive in more than one fragment."""
    seen: dict[int, int] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or []:
            raw = tc.model_dump(exclude_unset=True)
            if tc.index not in seen:
                assert tc.id and tc.type == "function" and tc.function.name, raw
                seen[tc.index] = 0
            else:
                assert set(raw) == {"index", "function"} and set(raw["function"]) == {"arguments"}, raw
            seen[tc.index] += 1
    assert sorted(seen) == list(range(n_calls))
    assert all(count > 2 for count in seen.values()), seen
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_auto_tool_calls_streamed_and_not(server, parser):
    state, engine, app = server
    state.tool_parser = parser

    async def scenario(client):
        return await three_ways(client, engine, SCRIPTS[parser], tools=TOOLS)

    whole, final, chunks = run(app, scenario)
    (choice,) = whole.choices
    assert calls_of(choice.message) == EXPECTED
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ("Checking." if parser == "hermes" else None)
    assert calls_of(final.choices[0].message) == EXPECTED
    assert final.choices[0].message.content == choice.message.content
    assert final.choices[0].finish_reason == "tool_calls"
    check_deltas(chunks, 2)
    # The template saw the tools.
    assert all('"name": "get_weather"' in p for p in engine.prompts)


def test_parallel_tool_calls_false_keeps_the_first(server):
    _state, engine, app = server

    async def scenario(client):
        return await three_ways(client, engine, SCRIPTS["hermes"], tools=TOOLS, parallel_tool_calls=False)

    whole, final, chunks = run(app, scenario)
    assert calls_of(whole.choices[0].message) == EXPECTED[:1]
    assert calls_of(final.choices[0].message) == EXPECTED[:1]
    check_deltas(chunks, 1)


def test_plain_answers_and_tool_choice_none(server):
    _state, engine, app = server
    text = "No tools needed.\n"

    async def scenario(client):
        plain = await three_ways(client, engine, text, tools=TOOLS)
        none = await three_ways(client, engine, SCRIPTS["hermes"], tools=TOOLS, tool_choice="none")
        return plain, none

    plain, none = run(app, scenario)
    for response, expected in ((plain, text), (none, SCRIPTS["hermes"])):
        whole, final, chunks = response
        for out in (whole, final):
            assert out.choices[0].message.content == expected
            assert not out.choices[0].message.tool_calls
            assert out.choices[0].finish_reason == "stop"
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert all('"name": "get_weather"' in p for p in engine.prompts)  # "none" still shows the tools


def test_a_tool_conversation_reaches_the_template(server):
    _state, engine, app = server
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "call_7", "content": "22 C, sunny"}]
    engine.script.append("It is 22 C and sunny.")

    async def scenario(client):
        return await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)

    out = run(app, scenario)
    assert out.choices[0].message.content == "It is 22 C and sunny."
    (prompt,) = engine.prompts
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response id="call_7">\n22 C, sunny\n</tool_response>' in prompt


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "requires --enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        (
            {"tools": TOOLS, "tool_choice": "required", "extra_body": {"guided_regex": "a+"}},
            "cannot be combined",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "different function names"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400(server, kw, match):
    state, engine, app = server
    state.tool_parser = None  # no --enable-auto-tool-choice

    async def scenario(client):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=MESSAGES, **kw)
        return err.value

    err = run(app, scenario)
    assert err.status_code == 400 and match in str(err.message)
    assert engine.prompts == []


# -- the output side of "required" and named tool_choice (the scripted engine ignores the
# constraint: `constrain` is replaced, and the script is what the constrained model would write)


@pytest.fixture
def unconstrained(monkeypatch):
    schemas = []
    monkeypatch.setattr(tool_calls, "constrain", lambda params, schema: schemas.append(schema))
    return schemas


def test_required_output_is_read_as_calls(server, unconstrained):
    state, engine, app = server
    state.tool_parser = None  # "required" reads its JSON whatever the parser flag
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "CET"}}]'

    async def scenario(client):
        return await three_ways(client, engine, text, tools=TOOLS, tool_choice="required")

    whole, final, chunks = run(app, scenario)
    for out in (whole, final):
        assert calls_of(out.choices[0].message) == EXPECTED
        assert out.choices[0].message.content is None
        assert out.choices[0].finish_reason == "tool_calls"
    check_deltas(chunks, 2)
    assert unconstrained[0] == tool_calls.tool_choice_schema(TOOLS, "required", True)


def test_named_output_is_the_arguments(server, unconstrained):
    _state, engine, app = server
    choice = {"type": "function", "function": {"name": "get_time"}}
    text = '{"tz": "CET"}'

    async def scenario(client):
        return await three_ways(client, engine, text, tools=TOOLS, tool_choice=choice)

    whole, final, chunks = run(app, scenario)
    for out in (whole, final):
        assert calls_of(out.choices[0].message) == [("get_time", {"tz": "CET"})]
        assert out.choices[0].finish_reason == "stop"  # as OpenAI, for a named function
    assert unconstrained[0] == TOOLS[1]["function"]["parameters"]
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_time" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == text
