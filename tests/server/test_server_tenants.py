"""API keys and tenants: 401 without a valid key, 429 over a tenant's limits, no prefix-cache sharing
across tenants while one tenant's repeated prompt does hit the cache."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from server_utils import FAST_ARGS, RemoteServer

from tandem.core.limits import MAX_CACHE_SALT_CHARS
from tandem.engine.core_client import RequestStream
from tandem.engine.messages import EngineCoreRequest
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.serving import EngineCall, ServerState
from tandem.entrypoints.openai.tenants import Tenants
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

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


def test_cache_salt_is_bounded(server):
    """A salt is an identifier: one past the bound is a 400 naming `cache_salt` (before, 8 MB salts
    were taken, and each stayed in the engine for good)."""
    with server.http(headers=auth("key-a")) as http:
        ok = http.post("/v1/completions", json={**BODY, "cache_salt": "s" * MAX_CACHE_SALT_CHARS})
        assert ok.status_code == 200, ok.text
        long = http.post("/v1/completions", json={**BODY, "cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)})
        assert long.status_code == 400
        assert long.json()["error"]["param"] == "cache_salt"


def test_max_concurrent_counts_sequences_not_prompts(server):
    """Tenant d may run one sequence at a time: n=2 or best_of=2 is more than it may ever run (400,
    not a 429 to retry forever). Before, each request counted as one, so a tenant limited to 1 ran
    n=16. (Holding seats with a running n > 1 request: test_admission_reserves_every_sequence.)"""
    with server.http(headers=auth("key-d")) as http:
        for extra in ({"n": 2}, {"best_of": 2}):
            resp = http.post("/v1/completions", json={**BODY, **extra})
            assert resp.status_code == 400, (extra, resp.text)
            assert "sequences" in resp.json()["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 400
        assert http.post("/v1/completions", json=BODY).status_code == 200


# -- in-process: EngineCall's charging against a fake engine client -----------------------------


class FakeClient:
    """What EngineCall uses of AsyncEngineClient."""

    def __init__(self) -> None:
        self.inputs = object()
        self.dead = None
        self.streams: dict[str, RequestStream] = {}

    @property
    def num_waiting(self) -> int:
        return 0

    def add(self, req, text, notify, on_finish=None) -> RequestStream:
        stream = self.streams[req.request_id] = RequestStream(req.request_id, notify, on_finish)
        return stream

    def abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.streams.pop(rid, None)


def fake_state(tenants: Tenants) -> ServerState:
    return ServerState(
        model_name="m",
        metrics=ServerMetrics("m"),
        tenants=tenants,
        max_waiting_requests=8,
        drain_timeout=1.0,
        client=FakeClient(),  # type: ignore[arg-type]
    )


def engine_request(rid: str, n: int = 1) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(n=n, max_tokens=100), 100, 0.0)


def output(rid: str, tokens_per_sample: list[int], finished: bool = False) -> RequestOutput:
    samples = [CompletionOutput(i, "", [7] * k) for i, k in enumerate(tokens_per_sample)]
    return RequestOutput(rid, None, [1, 2, 3], samples, finished=finished)


def test_admission_reserves_every_sequence():
    tenants = Tenants({"k": {"tenant": "t", "max_concurrent": 3}})
    tenant = tenants.by_key["k"]
    state = fake_state(tenants)
    with EngineCall(state, tenant, [(engine_request("a", n=2), None)]) as call:
        call.start()
        assert tenant.inflight == 2
        with pytest.raises(OpenAIError) as exc, EngineCall(state, tenant, [(engine_request("b", n=2), None)]) as c2:
            c2.start()
        assert exc.value.status == 429
        with EngineCall(state, tenant, [(engine_request("c"), None)]) as c3:
            c3.start()
            assert tenant.inflight == 3
    assert tenant.inflight == 0
    with pytest.raises(OpenAIError) as exc, EngineCall(state, tenant, [(engine_request("d", n=4), None)]) as c4:
        c4.start()
    assert exc.value.status == 400 and tenant.inflight == 0


def test_generated_tokens_are_charged_as_they_are_produced():
    """A running request's tokens count against its tenant's next admission at once (before, only
    when it ended, so a long request or many at once ran far past tokens_per_minute), and each token
    is charged once."""
    tenants = Tenants({"k": {"tenant": "t", "tokens_per_minute": 30}})
    tenant = tenants.by_key["k"]
    state = fake_state(tenants)

    async def scenario() -> None:
        with EngineCall(state, tenant, [(engine_request("a", n=2), None)]) as call:
            call.start()
            assert tenant.window_tokens == 3
            updates = call.updates()
            call.streams[0].put(output("a", [10, 8]))
            await asyncio.wait_for(updates.__anext__(), 5)
            assert tenant.window_tokens == 3 + 18
            call.streams[0].put(output("a", [12, 9]))
            await asyncio.wait_for(updates.__anext__(), 5)
            assert tenant.window_tokens == 3 + 21
            # 24 charged: a prompt of 3 still fits.
            with EngineCall(state, tenant, [(engine_request("b"), None)]) as other:
                other.start()
            assert tenant.window_tokens == 27
            call.streams[0].put(output("a", [15, 10], finished=True))
            await asyncio.wait_for(updates.__anext__(), 5)
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(updates.__anext__(), 5)
        # Closing charges only what had not been charged yet: each token once.
        assert tenant.window_tokens == 27 + 4
        assert tenant.inflight == 0
        with pytest.raises(OpenAIError) as exc, EngineCall(state, tenant, [(engine_request("c"), None)]) as c:
            c.start()
        assert exc.value.status == 429

    asyncio.run(scenario())
