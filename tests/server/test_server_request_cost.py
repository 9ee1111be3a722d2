"""What a request costs the server before it is refused (issue 41, defects 2, 7 and 12, and the tool
items of its part two), against `tandem serve` with an API key and a short context:

- everything a chat template renders (tool schemas, tool-call arguments, names) counts toward the
  length pre-check, so an oversized request is refused by its characters, before rendering;
- the API key is checked from the headers before the body is read (a huge unauthenticated body
  gets its 401 without being sent; invalid JSON without a key is a 401, not a 400);
- `logit_bias` is bounded by its entry count before any entry is looked at;
- a prompt of exactly `max_model_len` tokens can be scored (`echo` + `max_tokens: 0`, and
  `truncate_prompt_tokens: -1` for a longer one);
- a chat template that ignores `tools` is named in the server log.
"""

from __future__ import annotations

import json
import socket

import openai
import pytest
import torch
from server_utils import FAST_ARGS, RemoteServer

MODEL = "tiny"
KEY = "sk-request-cost"
MAX_MODEL_LEN = 64
TOL = 1e-4
CHAT = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "hi"}]
# Far past what 64 tokens can hold whatever it tokenizes to (the tiny tokenizer's longest token is
# 32 characters: 2 * 32 * 64 = 4096 characters at most), yet quick to render on today's code.
BIG = 100_000


def tool(name: str = "get_weather", description: str = "The weather in a city", **params) -> dict:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, **params}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


@pytest.fixture(scope="module")
def server(llama_dir):
    args = [*FAST_ARGS, "--served-model-name", MODEL, "--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN)]
    # A body that never arrives is not what ends these tests: the 401 must come first.
    args += ["--body-timeout", "300"]
    with RemoteServer(llama_dir, *args) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with server.http(headers={"Authorization": f"Bearer {KEY}"}) as h:
        yield h


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


def refused_by_length(resp, param: str = "messages") -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    # Refused by its characters, before the template rendered it (not by its token count after).
    assert "characters" in error["message"] and "cannot fit in max_model_len" in error["message"], error


# -- defect 2: everything the template renders counts -----------------------------------------------


def test_tool_call_arguments_count_toward_the_length_check(http):
    arguments = json.dumps({"city": "x" * BIG})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    refused_by_length(http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1}))


def test_a_tool_schema_counts_toward_the_length_check(http):
    tools = [tool(description="d" * BIG)]
    body = {"model": MODEL, "messages": QUESTION, "tools": tools, "tool_choice": "none", "max_tokens": 1}
    refused_by_length(http.post(CHAT, json=body))
    tools = [tool(note={"type": "string", "enum": [f"v{i}" for i in range(BIG // 8)]})]
    refused_by_length(http.post(CHAT, json={**body, "tools": tools}))


def test_many_small_tools_count_toward_the_length_check(http):
    tools = [tool(name=f"f{i}") for i in range(2000)]
    body = {"model": MODEL, "messages": QUESTION, "tools": tools, "tool_choice": "none", "max_tokens": 1}
    refused_by_length(http.post(CHAT, json=body))


def test_other_message_fields_count_toward_the_length_check(http):
    messages = [{"role": "user", "content": "hi", "name": "n" * BIG}]
    refused_by_length(http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1}))


def test_tokenize_with_tools_counts_them(http):
    body = {"model": MODEL, "messages": QUESTION, "tools": [tool(description="d" * BIG)]}
    refused_by_length(http.post("/tokenize", json=body))


def test_a_legal_tool_request_is_answered(client):
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[tool()], tool_choice="none", max_tokens=2, temperature=0
    )
    assert out.choices[0].finish_reason == "length"


def test_a_template_that_ignores_tools_is_named_in_the_log(server, client):
    """The tiny model's template never reads `tools`: the model cannot see them, and the server says
    so (once) instead of answering tool_calls=[] in silence."""
    client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[tool()], tool_choice="none", max_tokens=1, temperature=0
    )
    log = server.logs()
    assert "chat template ignores `tools`" in log, log[-2000:]
    assert "--chat-template" in log


# -- defect 7 and 12: the key before the body ----------------------------------------------------------


def raw_head(server, head: str, timeout: float = 60.0) -> str:
    """Send request headers only (no body) and return the response's status line and headers."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.decode("latin-1")


@pytest.mark.parametrize("auth", ["", "Authorization: Bearer wrong-key\r\n", "Authorization: Basic abc\r\n"])
def test_an_unauthenticated_body_is_refused_before_it_is_read(server, auth):
    """Headers announcing a 30 MB body, and no body: the 401 arrives without it (before, the
    server waited for the whole body, parsed it, and only then looked at the key)."""
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {30 << 20}\r\n\r\n"
    )
    response = raw_head(server, head)
    assert response.startswith("HTTP/1.1 401"), response[:200]
    assert "connection: close" in response.lower()


def test_a_huge_unauthenticated_chunked_body_is_refused_before_it_is_read(server):
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    assert raw_head(server, head).startswith("HTTP/1.1 401")


def test_invalid_json_is_a_401_without_a_key_and_a_400_with_one(server, http):
    with server.http() as anonymous:
        resp = anonymous.post(CHAT, content=b"{not json", headers={"Content-Type": "application/json"})
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "authentication_error"
        # Routes without a key stay open.
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/version").status_code == 200
    resp = http.post(CHAT, content=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == "the request body is not valid JSON"


def test_logit_bias_is_bounded_by_its_entry_count_first(http):
    """5,000 entries (more than the documented 4,096), one of them not a token id: refused for the
    count, before any entry was looked at."""
    bias = {str(i): 1.0 for i in range(5000)}
    bias["not-a-token"] = 1.0
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": bias}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "logit_bias" and "4096" in error["message"], error


def test_a_body_with_a_million_object_members_is_refused_before_it_is_parsed(http):
    """A logit_bias of 1M entries held the event loop 0.7-3 s in the JSON parse alone: refused (413)
    from a count over its bytes. A body of as many array elements (token ids) still parses."""
    from tandem.entrypoints.openai.serving import MAX_BODY_OBJECT_MEMBERS

    bias = ",".join(f'"{i}": 1' for i in range(1_000_000))
    body = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 1, "logit_bias": {{{bias}}}}}'.encode()
    resp = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert str(MAX_BODY_OBJECT_MEMBERS) in resp.json()["error"]["message"]
    # Colons inside strings alone do not refuse a body.
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "a:" * 70_000, "max_tokens": 1})
    assert resp.status_code == 400 and "max_model_len" in resp.json()["error"]["message"], resp.text


# -- defect 12: a prompt of exactly max_model_len tokens can be scored ------------------------------------


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(llama_dir))


def reference(hf, ids: list[int]) -> torch.Tensor:
    """Row j: the log-softmax after prompt position j (predicting token j + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def long_ids(hf, n: int) -> list[int]:
    ids = hf[1].encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n")
    return (ids * (n // len(ids) + 1))[:n]


def check_scored(hf, ids: list[int], choice: dict, http) -> None:
    ref = reference(hf, ids)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1:])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()
    last = lp["top_logprobs"][-1]
    assert abs(max(last.values()) - ref[-2].max().item()) < TOL
    text = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert choice["text"] == text
    assert choice["finish_reason"] == "length"
    pl = choice["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    entry = pl[-1][str(ids[-1])]
    assert abs(entry["logprob"] - ref[-2, ids[-1]].item()) < TOL
    assert entry["rank"] == int((ref[-2] > ref[-2, ids[-1]]).sum()) + 1


def test_a_prompt_of_max_model_len_tokens_can_be_scored(http, hf, client):
    ids = long_ids(hf, MAX_MODEL_LEN)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    (choice,) = out["choices"]
    check_scored(hf, ids, choice, http)
    assert out["usage"]["prompt_tokens"] == MAX_MODEL_LEN and out["usage"]["completion_tokens"] == 0
    # Streamed: the same prompt, logprobs and finish.
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == choice["text"]
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=TOL)
    assert chunks[-1].finish_reason == "length"
    # Still nothing past max_model_len, and generation at full length is still refused.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**{**body, "prompt": ids + ids[:1]})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1)


def test_a_longer_prompt_truncated_to_max_model_len_can_be_scored(http, hf):
    ids = long_ids(hf, MAX_MODEL_LEN + 9)
    body = {"model": MODEL, "prompt": [ids, ids[:5]], "max_tokens": 0, "echo": True, "logprobs": 1,
            "truncate_prompt_tokens": -1}  # fmt: skip
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    check_scored(hf, ids[-MAX_MODEL_LEN:], choices[0], http)
    check_scored(hf, ids[:5], choices[1], http)
    assert resp.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN + 5
