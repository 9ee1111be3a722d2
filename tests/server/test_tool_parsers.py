"""Tool-call parsers: each format, several calls, malformed text left as content, and streaming:
the text fed in any chunks accumulates to exactly the whole-text parse."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from tandem.entrypoints.openai.tool_parsers.base import Parsed, ParsedCall, ToolParser

HERMES, LLAMA, MISTRAL = TOOL_PARSERS["hermes"], TOOL_PARSERS["llama3_json"], TOOL_PARSERS["mistral"]


def streamed(parser: ToolParser, text: str, cuts: list[int]) -> Parsed:
    """Feed growing prefixes of `text`, accumulate the deltas as a client would."""
    reader = parser.reader()
    content = ""
    calls: list[dict] = []
    deltas = [reader.feed(text[:cut]) for cut in sorted(set(cuts)) if 0 < cut <= len(text)]
    deltas += [reader.feed(text), reader.finish()]
    for d in deltas:
        content += d.content
        for piece in d.calls:
            if piece.index == len(calls):
                assert piece.id and piece.name, "a call's first delta names it"
                calls.append({"id": piece.id, "name": piece.name, "arguments": ""})
            else:
                assert piece.index == len(calls) - 1 and piece.id is None and piece.name is None
            calls[piece.index]["arguments"] += piece.arguments
    return Parsed(content, [ParsedCall(**c) for c in calls])


def shape(p: Parsed) -> tuple:
    return (p.content or "", [(c.name, c.arguments) for c in p.calls])


def call_text(name: str, args: dict, key: str = "arguments", indent: int | None = None) -> str:
    return json.dumps({"name": name, key: args}, indent=indent, ensure_ascii=False)


# -- each format -----------------------------------------------------------------------------


def test_hermes_several_calls_and_content():
    text = (
        "Let me look.\n<tool_call>\n"
        + call_text("get_weather", {"city": "Paris", "unit": "celsius"})
        + "\n</tool_call>\n<tool_call>\n"
        + call_text("get_time", {"tz": "CET"})
        + "\n</tool_call>"
    )
    out = HERMES.parse(text)
    assert out.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert len({c.id for c in out.calls}) == 2 and all(c.id.startswith("call_") for c in out.calls)


def test_hermes_call_only_has_no_content_and_qwen_is_hermes():
    out = get_tool_parser("qwen").parse('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n')
    assert out.content is None and [(c.name, c.arguments) for c in out.calls] == [("f", "{}")]


def test_hermes_other_key_order_and_string_arguments():
    out = HERMES.parse('<tool_call>{"arguments": {"x": [1, 2]}, "name": "f"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"x": [1, 2]})]
    out = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"x": 1})]


def test_llama3_json_with_and_without_python_tag():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "parameters": {}}'
    out = LLAMA.parse(text)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("a", {"q": "x;y"}), ("b", {})]
    out = LLAMA.parse('  {"type": "function", "name": "a", "parameters": {"n": 1}}')
    assert [(c.name, c.arguments) for c in out.calls] == [("a", '{"n": 1}')]


def test_llama3_json_only_at_the_start():
    text = 'Sure: {"name": "a", "parameters": {}}'
    assert shape(LLAMA.parse(text)) == (text, [])
    text = '{"answer": 42} is the JSON you wanted'
    assert shape(LLAMA.parse(text)) == (text, [])


def test_mistral_array_and_ids():
    text = '[TOOL_CALLS] [{"name": "a", "arguments": {"q": 1}}, {"name": "b", "arguments": {"r": [true]}}]'
    out = MISTRAL.parse(text)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("a", {"q": 1}), ("b", {"r": [True]})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in out.calls)
    assert MISTRAL.keep_special_tokens


@pytest.mark.parametrize(
    "parser,text",
    [
        (HERMES, "Here: <tool_call>not json</tool_call> after"),
        (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut short
        (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>'),  # bracket mismatch
        (HERMES, '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
        (HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        (HERMES, "a <tool_ca"),
        (LLAMA, '{"name": "f", "parameters": {"a": tru}}'),
        (LLAMA, "{not json at all"),
        (MISTRAL, "[TOOL_CALLS] oops"),
        (MISTRAL, '[TOOL_CALLS] [{"nam'),
    ],
)
def test_malformed_text_is_content(parser, text):
    assert shape(parser.parse(text)) == (text, [])


def test_malformed_section_after_good_calls_keeps_the_calls():
    text = 'A\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>garbage'
    out = HERMES.parse(text)
    assert shape(out) == ("A\n<tool_call>garbage", [("f", "{}")])
    assert shape(streamed(HERMES, text, list(range(len(text))))) == shape(out)


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match=r"unknown tool call parser 'nope'.*hermes"):
        get_tool_parser("nope")


# -- streaming equals the whole parse, however the text is cut -------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.sampled_from(["get_weather", "search", "f", "add_numbers"])
# Content that cannot open a section of any of the formats by accident.
words = st.text(alphabet="abc xyz<>/_[]{}\"'\n\\;,é你", min_size=1, max_size=20).filter(
    lambda s: s.strip() and "<tool_call>" not in s and "[TOOL_CALLS]" not in s
)
calls_st = st.lists(st.tuples(names, arguments, st.sampled_from([None, 1])), min_size=1, max_size=3)


def cuts_for(text_len: int):
    return st.lists(st.integers(0, max(text_len, 1)), max_size=12)


def check_stream(parser: ToolParser, text: str, cuts: list[int], calls: list, content_chars: str) -> None:
    whole = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [(n, a) for n, a, _ in calls]
    assert re.sub(r"\s", "", whole.content or "") == re.sub(r"\s", "", content_chars)
    assert shape(streamed(parser, text, cuts)) == shape(whole)
    # One character at a time, too.
    assert shape(streamed(parser, text, list(range(len(text))))) == shape(whole)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), calls=calls_st, before=st.one_of(st.none(), words), after=st.one_of(st.none(), words))
def test_hermes_stream_equals_parse(data, calls, before, after):
    blocks = [f"<tool_call>\n{call_text(n, a, indent=i)}\n</tool_call>" for n, a, i in calls]
    text = (before + "\n" if before else "") + "\n".join(blocks) + ("\n" + after if after else "")
    check_stream(HERMES, text, data.draw(cuts_for(len(text))), calls, (before or "") + (after or ""))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), calls=calls_st, tag=st.booleans(), after=st.one_of(st.none(), words))
def test_llama3_stream_equals_parse(data, calls, tag, after):
    after = after if after is None or not after.lstrip().startswith(";") else None
    text = ("<|python_tag|>" if tag else "") + "; ".join(call_text(n, a, "parameters", i) for n, a, i in calls)
    text += " " + after if after else ""
    check_stream(LLAMA, text, data.draw(cuts_for(len(text))), calls, after or "")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), calls=calls_st, before=st.one_of(st.none(), words))
def test_mistral_stream_equals_parse(data, calls, before):
    text = (before + " " if before else "") + "[TOOL_CALLS] [" + ", ".join(call_text(n, a, indent=i) for n, a, i in calls) + "]"
    check_stream(MISTRAL, text, data.draw(cuts_for(len(text))), calls, before or "")


# Text made of the formats' own pieces, so that sections open, break and close in every way.
PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name": "f", "arguments": ',
          '{"name": "g", "parameters": ', '{"a": [1, "}"]}', "{}", "}", "]", "[", ";", ",", " ", "\n", "x", '"', "\\"]
texts = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=14).map("".join)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), text=texts)
def test_any_text_streams_as_it_parses(data, text):
    """Whatever the model writes (calls or not, well formed or not), a stream that does not cut a
    call short accumulates to the whole parse; text with no section is content, unchanged."""
    for parser in (HERMES, LLAMA, MISTRAL):
        whole = parser.parse(text)
        reader = parser.reader()
        reader.feed(text)
        reader.finish()
        if not reader.broken:
            assert shape(streamed(parser, text, data.draw(cuts_for(len(text))))) == shape(whole)
        if not whole.calls and "<tool_call>" not in text and "[TOOL_CALLS]" not in text and not text.lstrip().startswith(("{", "<|python_tag|>")):
            assert whole.content == text
