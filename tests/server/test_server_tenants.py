"""API keys and tenants: 401 without a valid key, 429 over a tenant's limits, no prefix-cache sharing
across tenants while one tenant's repeated prompt does hit the cache."""

from __future__ import annotations

import json
import time

import openai
import pytest
from server_utils import FAST_ARGS, RemoteServer

from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.tenants import Tenants

KEYS = {
    "key-a": {"tenant": "a", "priority": 0},
    "key-b": {"tenant": "b"},
    "key-c": {"tenant": "c", "tokens_per_minute": 30},
    "key-d": {"tenant": "d", "max_concurrent": 1},
}
BODY = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True}
METRICS_KEY = "metrics-secret"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with RemoteServer(
        llama_dir,
        *FAST_ARGS,
        "--served-model-name",
        "tiny",
        "--api-keys-file",
        str(keys),
        "--metrics-api-key",
        METRICS_KEY,
    ) as s:
        yield s


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_missing_or_wrong_key_is_401(server):
    with server.http() as http:
        for headers in ({}, auth("wrong"), {"Authorization": "key-a"}):
            resp = http.post("/v1/completions", json=BODY, headers=headers)
            assert resp.status_code == 401, headers
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        # Even a malformed body is refused before it is looked at.
        assert http.post("/v1/completions", json={"x": 1}).status_code == 401
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=auth("key-b")).status_code == 200
        # Health is open; metrics (tenant names and counts) need the metrics key, not a tenant's.
        assert http.get("/health").status_code == 200
        for headers in ({}, auth("key-a"), auth("wrong")):
            resp = http.get("/metrics", headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert http.get("/metrics", headers=auth(METRICS_KEY)).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    ok = server.client(api_key="key-a").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_tokens_per_minute_limit_is_429(server):
    with server.http(headers=auth("key-c")) as http:
        first = http.post("/v1/completions", json={**BODY, "max_tokens": 25})
        assert first.status_code == 200
        second = http.post("/v1/completions", json=BODY)
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(second.headers["retry-after"]) <= 60
    # Another tenant is unaffected.
    with server.http(headers=auth("key-b")) as http:
        assert http.post("/v1/completions", json=BODY).status_code == 200


def test_max_concurrent_limit_is_429(server):
    long = {**BODY, "max_tokens": 1000, "stream": True}
    with (
        server.http(headers=auth("key-d")) as http,
        http.stream("POST", "/v1/completions", json=long) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)
        second = http.post("/v1/completions", json=BODY)
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
        with server.http(headers=auth("key-a")) as other:
            assert other.post("/v1/completions", json=BODY).status_code == 200
        resp.close()
    # The slot comes back once the first request is gone.
    with server.http(headers=auth("key-d")) as http:
        deadline = time.monotonic() + 15
        while (status := http.post("/v1/completions", json=BODY).status_code) == 429:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert status == 200


def test_tenants_never_share_prefix_cache(server):
    prompt = "import collections\n" * 12  # several full KV blocks
    body = {**BODY, "prompt": prompt, "max_tokens": 1}

    def send(key: str) -> float:
        with server.http(headers=auth(key)) as http:
            assert http.post("/v1/completions", json=body).status_code == 200
        return server.metrics(METRICS_KEY)["tandem:prefix_cache_hits_total"]

    start = server.metrics(METRICS_KEY)["tandem:prefix_cache_hits_total"]
    after_a = send("key-a")
    assert after_a == start  # first sight of this prompt
    after_b = send("key-b")
    assert after_b == after_a  # tenant b gets nothing from tenant a's blocks
    after_a2 = send("key-a")
    assert after_a2 >= after_a + 16  # tenant a reuses its own
    after_b2 = send("key-b")
    assert after_b2 >= after_a2 + 16  # and so does tenant b
    m = server.metrics(METRICS_KEY)
    assert m['tandem:tenant_requests_total{outcome="finished",tenant="a"}'] >= 2
    assert m['tandem:tenant_prompt_tokens_total{tenant="b"}'] > 0


def test_tenants_parsing_and_limits():
    t = Tenants.from_args("single", None)
    assert t.authenticate("Bearer single").name == "default"
    assert Tenants().authenticate(None) is None  # auth off
    many = Tenants(KEYS)
    a, b = many.authenticate("Bearer key-a"), many.authenticate("bearer key-b")
    assert a.cache_salt != b.cache_salt and a.priority == 0
    d = many.authenticate("Bearer key-d")
    many.admit(d, 1, 3)
    with pytest.raises(OpenAIError) as exc:
        many.admit(d, 1, 3)
    assert exc.value.status == 429
    many.release(d, 1, 5)
    many.admit(d, 1, 3)
    for bad in (
        {"k": {"tenant": ""}},
        {"k": {"tenant": "x", "max_concurrent": 0}},
        {"k": {"tenant": "x", "rpm": 1}},
    ):
        with pytest.raises(ValueError):
            Tenants(bad)
