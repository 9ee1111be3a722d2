"""Structured output through `tandem serve` with the official openai SDK: `chat.completions.parse`
with a pydantic model, `response_format` json_object and json_schema on chat and completions,
vLLM's `structured_outputs` and `guided_*` fields, and a 400 naming the field for a bad spec."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import FAST_ARGS, RemoteServer

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe a pet."}]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def server(llama_dir):
    with RemoteServer(llama_dir, *FAST_ARGS, "--served-model-name", MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_chat_parse_with_pydantic_model(client):
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=100, temperature=temperature, seed=1
        )
        msg = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Pet)
        assert Pet.model_validate_json(msg.content or "") == msg.parsed
    beta = getattr(getattr(client, "beta", None), "chat", None)
    if beta is not None:  # the older spelling, where the installed SDK still has it
        parsed = beta.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=100)
        assert isinstance(parsed.choices[0].message.parsed, Pet)


def test_json_object_chat_and_completions(client):
    # Any object: a random model may write keys for ever, so a choice may end by length (then it is
    # an unfinished object); those that stop are whole objects, and some do stop.
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=60, n=6, seed=0
    )
    stopped = [c for c in chat.choices if c.finish_reason == "stop"]
    assert stopped
    for c in chat.choices:
        assert (c.message.content or "").startswith("{")
    for c in stopped:
        assert isinstance(json.loads(c.message.content or ""), dict)
    schema = Pet.model_json_schema()
    comp = client.completions.create(
        model=MODEL,
        prompt="A pet:",
        max_tokens=100,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}},
    )
    Pet.model_validate_json(comp.choices[0].text)
    text = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "text"}, max_tokens=4, temperature=0.0
    )
    assert text.choices[0].message.content is not None


def test_structured_outputs_and_guided_fields(client):
    pattern = r"[A-Z]{2}-\d{3}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        comp = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, n=2, extra_body=body)
        for c in comp.choices:
            assert re.fullmatch(pattern, c.text), c.text
    choices = ["red", "green", "blue"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, extra_body=body)
        assert chat.choices[0].message.content in choices
    grammar = 'root ::= "yes" | "no"'
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, extra_body={"guided_grammar": grammar}
    )
    assert chat.choices[0].message.content in ("yes", "no")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    for body in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        comp = client.completions.create(model=MODEL, prompt="{", max_tokens=20, extra_body=body)
        assert set(json.loads(comp.choices[0].text)) == {"ok"}
    # Streamed: the deltas join into valid output.
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, stream=True, extra_body={"guided_choice": choices}
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) in choices


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        # Deep JSON is a 400, not a RecursionError's 500.
        ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
        # A grammar past the grammar engine's limits fails on its first token: refused up front.
        ({"guided_grammar": 'root ::= "a" root'}, "guided_grammar"),
        # 40,000 chained rules (427 KB, under the 1 MiB cap) overflowed the API process's stack.
        ({"guided_grammar": "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(40_000)) + 'r40000: "a"\n'},
         "guided_grammar"),
    ],
    ids=lambda v: v if isinstance(v, str) else str(v)[:40],
)
def test_bad_specs_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert err.value.body is not None and err.value.body.get("param") == param, err.value.body
    # The server goes on serving.
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.choices[0].text is not None
