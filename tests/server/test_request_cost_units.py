"""In-process checks of what a request costs before it reaches the engine (issue 41, defects 2 and 7,
and the tool items of its part two): which work runs off the event loop (in the tokenizer threads,
`tandem-tokenize`), what is refused before any rendering, how a tool call cut inside its closing tag
reads, and the README's tool-calling example.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from tandem.core.limits import EngineLimits
from tandem.engine.processor import InputProcessor
from tandem.engine.tokenizer import Tokenizer, load_chat_template
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from tandem.entrypoints.openai.serving import ServerState, logit_bias, prepare
from tandem.entrypoints.openai.serving_chat import chat_prompt_ids
from tandem.entrypoints.openai.tenants import Tenants
from tandem.entrypoints.openai.tool_calls import plan_tools
from tandem.entrypoints.openai.tool_parsers import get_tool_parser
from tandem.sampling_params import SamplingParams

HERE = Path(__file__).parent
README = HERE.parents[1] / "README.md"
HERMES = (HERE / "hermes_tool_template.jinja").read_text()
BIG = 50_000  # characters: more than the server renders inline, and legal at max_model_len 4096


class Client:
    """What the serving layer uses of the engine client before a request is queued."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.limits = EngineLimits(tokenizer.vocab_size, max_model_len, 16, 1024, 8)
        self.inputs = InputProcessor(tokenizer, self.limits)
        self.dead = None
        self.num_waiting = 0


@pytest.fixture
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer(str(tokenizer_dir))


def make_state(tokenizer: Tokenizer, max_model_len: int, template: str | None = None) -> ServerState:
    state = ServerState(
        model_name="tiny",
        metrics=ServerMetrics("tiny"),
        tenants=Tenants(),
        max_waiting_requests=8,
        drain_timeout=1.0,
        chat_template=template,
    )
    state.client = Client(tokenizer, max_model_len)  # type: ignore[assignment]
    return state


def record(obj: Any, name: str) -> list[tuple[str, tuple[Any, ...]]]:
    """Wrap obj.name to record the thread and arguments of each call."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    original = getattr(obj, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        calls.append((threading.current_thread().name, args))
        return original(*args, **kw)

    setattr(obj, name, wrapper)
    return calls


def messages(*raw: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def tool(description: str = "The weather in a city") -> dict[str, Any]:
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    function = {"name": "get_weather", "description": description, "parameters": params}
    return {"type": "function", "function": function}


def call_message(arguments: str) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


USER = {"role": "user", "content": "hi"}
OFF_LOOP = "tandem-tokenize"


# -- defect 2 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "convo, tools",
    [
        ((USER, call_message('{"city": "' + "x" * BIG + '"}')), None),
        ((USER,), [tool("d" * BIG)]),
        ((USER,), [tool(f"tool {i}") for i in range(3000)]),
        (({**USER, "name": "n" * BIG},), None),
    ],
    ids=["tool-call-arguments", "tool-schema", "many-tools", "message-name"],
)
def test_what_the_template_renders_is_refused_by_length_before_rendering(tokenizer, convo, tools):
    state = make_state(tokenizer, max_model_len=64)
    rendered = record(tokenizer, "apply_chat_template")
    with pytest.raises(OpenAIError) as err:
        asyncio.run(chat_prompt_ids(state, messages(*convo), True, tools))
    assert err.value.status == 400 and err.value.param == "messages"
    assert "characters" in err.value.message and "cannot fit in max_model_len" in err.value.message
    assert rendered == []


@pytest.mark.parametrize(
    "convo, tools",
    [((USER, call_message('{"city": "' + "x" * BIG + '"}')), None), ((USER,), [tool("d" * BIG)])],
    ids=["tool-call-arguments", "tool-schema"],
)
def test_a_big_legal_conversation_renders_off_the_event_loop(tokenizer, convo, tools):
    state = make_state(tokenizer, max_model_len=4096, template=HERMES)
    rendered = record(tokenizer, "apply_chat_template")
    ids = asyncio.run(chat_prompt_ids(state, messages(*convo), True, tools))
    assert ids
    assert rendered and all(thread.startswith(OFF_LOOP) for thread, _ in rendered), rendered[:1]


def test_planning_a_big_tool_choice_runs_off_the_event_loop(tokenizer):
    """tool_choice "required" copies every tool's schema into the output's: off the loop too."""
    from tandem.entrypoints.openai import serving_chat

    state = make_state(tokenizer, max_model_len=4096, template=HERMES)
    body = ChatCompletionRequest.model_validate(
        {"messages": [USER], "tools": [tool("d" * BIG)], "tool_choice": "required", "max_tokens": 1}
    )
    threads: list[str] = []

    def planned(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return plan_tools(*args)

    original = serving_chat.plan_tools
    serving_chat.plan_tools = planned  # type: ignore[assignment]
    try:
        asyncio.run(serving_chat.plan_request_tools(state, body))
    finally:
        serving_chat.plan_tools = original  # type: ignore[assignment]
    assert threads and threads[0].startswith(OFF_LOOP)


# -- defect 7 ------------------------------------------------------------------------------------------


def test_bad_words_are_tokenized_once_per_request_off_the_event_loop(tokenizer):
    state = make_state(tokenizer, max_model_len=64)
    encoded = record(tokenizer, "encode")
    words = [f"w{i} " + "z" * 1000 for i in range(64)]
    params = SamplingParams(max_tokens=4, bad_words=words)
    body = CompletionRequest(prompt=["a", "b"])
    prepared = asyncio.run(prepare(state, "cmpl-1", ["a", "b"], params, body, None))
    assert len(prepared) == 2
    assert all(req.params.bad_words_token_ids for req, _ in prepared)
    word_calls = [(thread, args) for thread, args in encoded if "zzz" in args[0]]
    # Each word as written and after a space, once for the request (not once per prompt).
    assert len(word_calls) == 2 * len(words)
    assert all(thread.startswith(OFF_LOOP) for thread, _ in word_calls), word_calls[0][0]


class Untouchable(dict):
    """A mapping whose entries must not be looked at (only its size)."""

    def _refuse(self, *args: Any) -> Any:
        raise AssertionError("an entry was read before the count was checked")

    items = keys = values = __iter__ = __getitem__ = get = _refuse  # type: ignore[assignment]


def test_logit_bias_count_is_checked_before_any_entry():
    entries = Untouchable({str(i): 1.0 for i in range(5000)})
    with pytest.raises(OpenAIError) as err:
        logit_bias(SamplingFields.model_construct(logit_bias=entries))
    assert err.value.status == 400 and err.value.param == "logit_bias"
    assert "4096" in err.value.message


def test_the_request_bounds_logit_bias_allowed_token_ids_and_bad_words():
    from pydantic import ValidationError

    for field, value in (
        ("logit_bias", {str(i): 1.0 for i in range(5000)}),
        ("allowed_token_ids", list(range(5000))),
        ("bad_words", ["w"] * 100),
    ):
        with pytest.raises(ValidationError) as err:
            CompletionRequest.model_validate({"prompt": "x", field: value})
        assert err.value.errors()[0]["loc"][0] == field and err.value.errors()[0]["type"] == "too_long"


# -- part two: tools -----------------------------------------------------------------------------------


def test_a_template_that_ignores_tools_is_warned_about_once(tokenizer, caplog):
    state = make_state(tokenizer, max_model_len=4096)  # the tiny tokenizer's template: no tools
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            asyncio.run(chat_prompt_ids(state, messages(USER), True, [tool()]))
        asyncio.run(chat_prompt_ids(state, messages(USER), True, None))
    warnings = [r for r in caplog.records if "ignores `tools`" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "--chat-template" in warnings[0].getMessage()


def test_a_template_that_renders_tools_is_not_warned_about(tokenizer, caplog):
    state = make_state(tokenizer, max_model_len=4096, template=HERMES)
    with caplog.at_level(logging.WARNING):
        asyncio.run(chat_prompt_ids(state, messages(USER), True, [tool()]))
    assert not [r for r in caplog.records if "ignores `tools`" in r.getMessage()]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'


@pytest.mark.parametrize("cut", ["</tool_", "</", "</tool_call", "<"])
def test_a_call_cut_inside_its_closing_tag_is_a_call_without_the_fragment(cut):
    """max_tokens cut the output inside `</tool_call>`: the call is whole (its JSON is complete), so
    it is a call, and the fragment of the closing tag is not content, streamed or not."""
    parser = get_tool_parser("hermes")
    text = "Let me look. " + CALL + cut
    parsed = parser.parse(text)
    assert parsed.content == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Paris"}')]
    reader = parser.reader()
    content = "".join(reader.feed(text[: i + 1]).content for i in range(len(text)))
    content += reader.finish().content
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_call_cut_inside_its_json_leaves_the_whole_text_as_content():
    text = CALL[:-12]
    parsed = get_tool_parser("hermes").parse(text)
    assert parsed.content == text and parsed.calls == []


def readme_tool_section() -> str:
    text = README.read_text()
    return text[text.index("### Tool calling") : text.index("\n## ", text.index("### Tool calling"))]


def test_the_readme_tool_example_serves_a_template_that_renders_tools():
    from tandem.checkpoints import default_model_path

    section = readme_tool_section()
    serve = re.search(r"^tandem serve .*$", section, flags=re.M)
    assert serve is not None
    found = re.search(r'--chat-template\s+("[^"]+"|\S+)', serve.group(0))
    assert found is not None, serve.group(0)
    path = found.group(1).strip('"').replace("$(tandem models path)", default_model_path())
    template = load_chat_template(path)
    tok = Tokenizer(default_model_path())
    convo = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools = tok.apply_chat_template(convo, True, template, [tool()])
    assert with_tools != tok.apply_chat_template(convo, True, template)
    # required and named tool_choice work (structured output): no 400 promised for them.
    assert "400 saying so" not in section and "until it is\n  merged" not in section
