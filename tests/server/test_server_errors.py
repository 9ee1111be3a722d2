"""Malformed requests get 4xx with OpenAI's error body and leave the server healthy; a burst far above
--max-waiting-requests gets 503 for the excess while every accepted request completes in bounded memory."""

from __future__ import annotations

import asyncio

import pytest
from server_utils import RemoteServer, httpx

MAX_WAITING = 4

C = "/v1/completions"
CHAT = "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4}
MSGS = [{"role": "user", "content": "hi"}]

# (name, path, body (dict, or raw bytes), status, param the error should name or None)
BAD = [
    ("missing prompt", C, {"model": "tiny"}, 400, "prompt"),
    ("prompt is a number", C, {**OK, "prompt": 123}, 400, "prompt"),
    ("max_tokens is a string", C, {**OK, "max_tokens": "8"}, 400, "max_tokens"),
    ("max_tokens zero", C, {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", C, {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens beyond context", C, {**OK, "max_tokens": 5000}, 400, "max_tokens"),
    ("prompt beyond context", C, {**OK, "prompt": [5] * 1030}, 400, None),
    ("temperature negative", C, {**OK, "temperature": -1}, 400, "temperature"),
    ("temperature is text", C, {**OK, "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", C, {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p above one", C, {**OK, "top_p": 1.5}, 400, "top_p"),
    ("n zero", C, {**OK, "n": 0}, 400, "n"),
    ("n is a float", C, {**OK, "n": 1.5}, 400, "n"),
    ("logprobs too many", C, {**OK, "logprobs": 50}, 400, "logprobs"),
    ("prompt_logprobs too many", C, {**OK, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt_logprobs streamed", C, {**OK, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("presence_penalty out of range", C, {**OK, "presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency_penalty out of range", C, {**OK, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("top_k negative", C, {**OK, "top_k": -5}, 400, "top_k"),
    ("repetition_penalty zero", C, {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_tokens above max_tokens", C, {**OK, "min_tokens": 10}, 400, "min_tokens"),
    ("stop_token_ids negative", C, {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("stop_token_ids outside vocab", C, {**OK, "stop_token_ids": [10**6]}, 400, None),
    ("token id outside vocab", C, {**OK, "prompt": [1, 999999]}, 400, None),
    ("empty prompt", C, {**OK, "prompt": ""}, 400, None),
    ("empty prompt list", C, {**OK, "prompt": []}, 400, "prompt"),
    ("seed is text", C, {**OK, "seed": "x"}, 400, "seed"),
    ("stream is text", C, {**OK, "stream": "yes"}, 400, "stream"),
    ("unknown field", C, {**OK, "frobnicate": 1}, 400, "frobnicate"),
    ("logit_bias key not a token id", C, {**OK, "logit_bias": {"five": 3.0}}, 400, "logit_bias"),
    ("logit_bias above 100", C, {**OK, "logit_bias": {"5": 300.0}}, 400, "logit_bias"),
    ("logit_bias outside vocab", C, {**OK, "logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
    ("allowed_token_ids outside vocab", C, {**OK, "allowed_token_ids": [999999]}, 400, "allowed_token_ids"),
    ("allowed_token_ids empty", C, {**OK, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("best_of below n", C, {**OK, "n": 2, "best_of": 1}, 400, "best_of"),
    ("suffix without FIM tokens", C, {**OK, "suffix": "x"}, 400, "suffix"),
    ("body is not JSON", C, b"{not json", 400, None),
    ("body is a list", C, b"[1, 2]", 400, None),
    ("unknown model", C, {**OK, "model": "gpt-nope"}, 404, "model"),
    ("chat without messages", CHAT, {"model": "tiny"}, 400, "messages"),
    ("chat with no messages", CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat with a bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("chat content is a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("chat top_logprobs without logprobs", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat tool without a function", CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("chat tool_choice auto without --enable-auto-tool-choice", CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    (
        "chat response_format of an unknown type",
        CHAT,
        {"messages": MSGS, "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    ("chat unknown model", CHAT, {"messages": MSGS, "model": "nope"}, 404, "model"),
    ("tokenize with nothing", "/tokenize", {}, 400, None),
    ("detokenize outside vocab", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("unknown route", "/v1/nothing", {}, 404, None),
]


@pytest.fixture(scope="module")
def server(llama_dir):
    args = ["--num-kv-blocks", "64", "--max-num-seqs", "2", "--num-threads", "1"]
    args += ["--served-model-name", "tiny", "--max-waiting-requests", str(MAX_WAITING)]
    # The queue bound is what this module tests: no per-client connection bound in front of it.
    args += ["--max-connections-per-client", "0"]
    with RemoteServer(llama_dir, *args) as s:
        yield s


def test_malformed_requests_get_openai_errors(server):
    assert len(BAD) >= 20
    with server.http() as http:
        for name, path, body, status, param in BAD:
            if isinstance(body, bytes):
                resp = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                resp = http.post(path, json=body)
            assert resp.status_code == status, (name, resp.status_code, resp.text)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert isinstance(err["message"], str) and err["message"], name
            assert isinstance(err["type"], str) and err["type"], name
            if param is not None:
                assert err["param"] == param, (name, err)
        # Still serving.
        assert http.get("/health").status_code == 200
        ok = http.post(C, json=OK)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        stream = http.post(C, json={**OK, "stream": True, "max_tokens": 1000, "prompt": [5] * 100})
        assert stream.status_code == 400


async def _burst(url: str, n: int) -> list[httpx.Response]:
    body = {**OK, "max_tokens": 16, "ignore_eos": True}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(http.post(C, json=body) for _ in range(n)))


def test_burst_overload_rejects_excess_and_completes_the_rest(server):
    rss_before = server.rss_kb()
    statuses = []
    for _ in range(2):
        responses = asyncio.run(_burst(server.url, 60))
        statuses += [r.status_code for r in responses]
        for r in responses:
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                body = r.json()
                assert body["choices"][0]["finish_reason"] == "length"
                assert body["usage"]["completion_tokens"] == 16
            else:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "overloaded"
    assert statuses.count(200) >= MAX_WAITING and statuses.count(503) > 0
    # Bounded memory: two bursts cost no more than a modest, fixed amount.
    assert server.rss_kb() - rss_before < 150_000
    m = server.metrics()
    assert m["tandem:num_requests_running"] == 0
    assert m['tandem:tenant_requests_total{outcome="rejected",tenant="default"}'] == statuses.count(503)
    with server.http() as http:
        assert http.get("/health").status_code == 200
