"""Admission is one construct: whatever fails after a request is admitted gives its slot back.

In-process, no server: the engine client's registration, and `EngineCall`'s lifetime around it.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.core.limits import EngineLimits
from tandem.engine.core_client import AsyncEngineClient, EngineDeadError, RequestAbortedError, RequestStream
from tandem.engine.messages import EngineCoreRequest
from tandem.engine.processor import OutputProcessor
from tandem.engine.tokenizer import Tokenizer
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.serving import ClientDisconnected, EngineCall, ServerState
from tandem.entrypoints.openai.tenants import Tenants
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams


def request(rid: str, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), 4, 0.0, **kw)


class NoConnection:
    def send(self, payload: bytes) -> None:
        raise AssertionError("nothing may be sent")


@pytest.fixture
def client(tokenizer_dir):
    c = AsyncEngineClient(config=None, connections=[NoConnection()])
    c.tokenizer = Tokenizer(str(tokenizer_dir))
    c.outputs = OutputProcessor(c.tokenizer)
    c.limits = EngineLimits(512, 64, 16, 64, 4)
    c.instances.live = {0}
    return c


def test_an_unencodable_request_leaves_no_stream(client):
    """msgpack cannot carry 2**64: before, the stream stayed registered and held a waiting slot."""
    with pytest.raises(ValueError, match="cannot be sent"):
        client.add(request("r", priority=2**64), None, asyncio.Event())
    assert client.streams == {} and client.routes == {} and client.outputs.groups == {}
    assert client.num_waiting == 0


class FakeClient:
    """What EngineCall uses of AsyncEngineClient; `add` fails on the request named `fail_on`."""

    def __init__(self, fail_on: str | None = None, error: Exception | None = None) -> None:
        self.inputs = object()
        self.dead = None
        self.streams: dict[str, RequestStream] = {}
        self.aborted: list[str] = []
        self.fail_on = fail_on
        self.error = error or RuntimeError("unexpected")

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.streams.values() if not s.started)

    def add(self, req, text, notify, on_finish=None) -> RequestStream:
        if req.request_id == self.fail_on:
            raise self.error
        stream = self.streams[req.request_id] = RequestStream(req.request_id, notify, on_finish)
        return stream

    def abort(self, ids: list[str]) -> None:
        for rid in ids:
            if self.streams.pop(rid, None) is not None:
                self.aborted.append(rid)


def state_with(client: FakeClient, tenants: Tenants) -> ServerState:
    return ServerState(
        model_name="m",
        metrics=ServerMetrics("m"),
        tenants=tenants,
        max_waiting_requests=8,
        drain_timeout=1.0,
        client=client,
    )


@pytest.mark.parametrize("error", [RuntimeError("boom"), ValueError("bad"), KeyboardInterrupt()])
def test_a_failure_while_queueing_gives_everything_back(error):
    tenants = Tenants({"k": {"tenant": "t", "max_concurrent": 2}})
    tenant = tenants.by_key["k"]
    client = FakeClient(fail_on="r-1", error=error)
    state = state_with(client, tenants)
    prepared = [(request("r-0"), None), (request("r-1"), None)]
    with (
        pytest.raises((RuntimeError, OpenAIError, KeyboardInterrupt)),
        EngineCall(state, tenant, prepared) as call,
    ):
        call.start()
    assert tenant.inflight == 0
    assert client.streams == {} and client.aborted == ["r-0"]
    assert client.num_waiting == 0


def test_leaving_the_block_by_any_path_ends_the_call():
    tenants = Tenants({"k": {"tenant": "t", "max_concurrent": 1}})
    tenant = tenants.by_key["k"]
    client = FakeClient()
    state = state_with(client, tenants)
    with EngineCall(state, tenant, [(request("a-0"), None)]) as call:
        call.start()
        assert tenant.inflight == 1 and client.num_waiting == 1
    assert tenant.inflight == 0 and client.streams == {}
    # Handed to a streaming response, the call outlives the block until the response closes it.
    with EngineCall(state, tenant, [(request("b-0"), None)]) as call:
        call.start()
        response = call.stream_to(lambda c: c)
    assert tenant.inflight == 1
    response.close()
    assert tenant.inflight == 0 and client.streams == {}


def test_a_disconnect_wakes_the_waiting_handler_at_once():
    """The watcher reads the connection's own messages: no polling interval."""
    state = state_with(FakeClient(), Tenants())

    async def scenario() -> float:
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        loop = asyncio.get_running_loop()
        with EngineCall(state, None, [(request("c-0"), None)]) as call:
            call.start()
            call.watch(receive)
            loop.call_later(0.01, gone.set)
            start = loop.time()
            with pytest.raises(ClientDisconnected):
                async for _ in call.updates():
                    pass
            return loop.time() - start

    assert asyncio.run(scenario()) < 0.2


class DeadConnection:
    def send(self, payload: bytes) -> None:
        raise EngineDeadError("engine instance 0 is not reachable")


class Recording:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)


def test_a_request_sent_to_an_instance_that_just_died_runs_on_another(tokenizer_dir):
    """Dispatched to an instance whose death its output loop has not seen yet: the request is
    resumed on a live instance, not failed (before, the client got a 500 "not reachable")."""
    alive = Recording()
    c = AsyncEngineClient(config=None, connections=[DeadConnection(), alive])
    c.tokenizer = Tokenizer(str(tokenizer_dir))
    c.outputs = OutputProcessor(c.tokenizer)
    c.limits = EngineLimits(512, 64, 16, 64, 4)
    c.instances.live = {0, 1}
    c.dispatcher = Dispatcher(ClusterConfig(num_instances=2, dispatch_policy="round_robin"), [100, 100], 16)
    stream = c.add(request("e"), None, asyncio.Event())
    assert stream.error is None and not stream.finished
    assert c.routes == {"e": 1} and c.live == {1} and len(alive.sent) == 1
    # With no other instance left, the failure is the client's to see, and nothing stays registered.
    with pytest.raises(EngineDeadError):
        c.add(request("f"), None, asyncio.Event(), instance=0)
    assert "f" not in c.streams and "f" not in c.routes


def test_an_output_unread_when_the_stream_fails_is_followed_by_the_error():
    """A stream failed (shutdown abort) while an output waits unread: the reader gets the output,
    then the error, without another wake-up (before, it waited on `notify` for ever)."""
    state = state_with(FakeClient(), Tenants())

    async def scenario() -> list:
        seen: list = []
        with EngineCall(state, None, [(request("d-0"), None)]) as call:
            call.start()
            stream = call.streams[0]
            stream.put(RequestOutput("d-0", None, [1, 2, 3], [], finished=False))
            stream.fail(RequestAbortedError("shutdown"))
            with pytest.raises(RequestAbortedError):
                async for batch in call.updates():
                    seen.append(batch)
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    assert len(seen) == 1 and seen[0][0][1].request_id == "d-0"


def test_metrics_need_their_own_key_under_api_keys():
    """/metrics names every tenant: under API keys it needs the metrics key (a tenant's is not
    enough), or it lives on --metrics-port and the API port answers 404."""
    keyed = Tenants({"k": {"tenant": "t"}})
    state = state_with(FakeClient(), keyed)
    with pytest.raises(OpenAIError) as err:
        state.authorize_metrics("Bearer k")
    assert err.value.status == 401
    state.metrics_api_key = "m"
    for header in (None, "Bearer k", "Bearer x", "m"):
        with pytest.raises(OpenAIError) as err:
            state.authorize_metrics(header)
        assert err.value.status == 401
    state.authorize_metrics("Bearer m")
    open_state = state_with(FakeClient(), Tenants())
    open_state.authorize_metrics(None)  # no API keys: open, as vLLM's
    open_state.metrics_on_api_port = False
    with pytest.raises(OpenAIError) as err:
        open_state.authorize_metrics(None)
    assert err.value.status == 404
