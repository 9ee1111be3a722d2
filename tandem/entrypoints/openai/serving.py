"""What completions and chat share: server state, sampling parameters, admission, following outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.core import EngineCoreRequest
from tandem.engine.core_client import AsyncEngineClient, EngineDeadError, RequestAbortedError, RequestStream
from tandem.entrypoints.openai.errors import OpenAIError, bad_request
from tandem.entrypoints.openai.protocol import SamplingFields
from tandem.entrypoints.openai.tenants import Tenant, Tenants
from tandem.metrics import ServerMetrics
from tandem.outputs import Logprob, RequestOutput
from tandem.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerState:
    """Everything one server instance holds (no module-level state)."""

    model_name: str
    model_path: str
    metrics: ServerMetrics
    tenants: Tenants
    max_waiting_requests: int
    drain_timeout: float
    client: AsyncEngineClient | None = None
    draining: bool = False
    exit_code: int = 0
    request_exit: Callable[[], None] | None = None
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def engine(self) -> AsyncEngineClient:
        if self.client is None or self.client.inputs is None:
            raise OpenAIError(
                503, "the engine is starting", code="engine_starting", headers={"Retry-After": "1"}
            )
        if self.client.dead is not None:
            raise OpenAIError(500, f"the engine is not running: {self.client.dead}", code="engine_dead")
        return self.client

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def engine_died(self, reason: str) -> None:
        """Called by the client: in-flight requests have already been failed; exit non-zero shortly."""
        self.exit_code = 1
        if self.loop is not None and self.request_exit is not None:
            self.loop.call_later(1.0, self.request_exit)


def tenant_label(tenant: Tenant | None) -> str:
    return tenant.name if tenant is not None else "default"


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as exc:
        raise bad_request(exc) from exc


def prepare(
    state: ServerState,
    base_id: str,
    prompts: list[Any],
    params: SamplingParams,
    body: SamplingFields,
    tenant: Tenant | None,
) -> list[tuple[EngineCoreRequest, str | None]]:
    """Tokenize and validate every prompt (400 on any problem) before anything is queued.

    The queue bound is checked first, so an overloaded server turns requests away before spending
    time on them. Nothing awaits between this and `EngineCall.start`, so the check still holds there.
    """
    engine = state.engine
    if state.draining:
        raise OpenAIError(503, "the server is shutting down", headers={"Retry-After": "5"})
    n = len(prompts)
    if n > state.max_waiting_requests:
        raise bad_request(
            f"{n} prompts is more than this server queues ({state.max_waiting_requests})", "prompt"
        )
    if engine.num_waiting + n > state.max_waiting_requests:
        state.metrics.observe_rejected(tenant_label(tenant))
        raise OpenAIError(
            503,
            f"the server is overloaded ({engine.num_waiting} requests waiting); retry later",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
    priority = tenant.priority if tenant is not None and tenant.priority is not None else body.priority
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(
                engine.inputs.process(
                    f"{base_id}-{i}",
                    prompt,
                    params,
                    priority=priority,
                    tenant=None if tenant is None else tenant.name,
                    cache_salt=None if tenant is None else tenant.cache_salt,
                )
            )
        except ValueError as exc:
            raise bad_request(exc, "prompt" if len(prompts) > 1 and "prompt" in str(exc) else None) from exc
    return out


class ClientDisconnected(Exception):
    pass


class EngineCall:
    """The engine requests of one HTTP request: admitted together, followed together, aborted together."""

    def __init__(
        self, state: ServerState, tenant: Tenant | None, prepared: list[tuple[EngineCoreRequest, str | None]]
    ) -> None:
        self.state = state
        self.tenant = tenant
        self.label = tenant_label(tenant)
        self.prepared = prepared
        self.notify = asyncio.Event()
        self.streams: list[RequestStream] = []
        # The newest output read by the caller, and the final one as it arrived from the engine.
        self.last: list[RequestOutput | None] = [None] * len(prepared)
        self.final: list[RequestOutput | None] = [None] * len(prepared)
        self.admitted = False
        self.closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(req.prompt_token_ids) for req, _ in self.prepared)

    def start(self) -> None:
        """Admit (tenant limits: 429) and queue; the caller has `prepare`d (queue bound: 503) just before."""
        state, engine = self.state, self.state.engine
        n = len(self.prepared)
        if self.tenant is not None:
            try:
                state.tenants.admit(self.tenant, n, self.num_prompt_tokens)
            except OpenAIError:
                state.metrics.observe_rejected(self.label)
                raise
        self.admitted = True
        try:
            for i, (req, text) in enumerate(self.prepared):
                self.streams.append(engine.add(req, text, self.notify, self._finisher(i)))
        except EngineDeadError as exc:
            self.close()
            raise OpenAIError(500, f"the engine is not running: {exc}", code="engine_dead") from exc
        except ValueError as exc:
            self.close()
            raise bad_request(exc) from exc

    def _finisher(self, i: int) -> Callable[[RequestOutput], None]:
        def on_finish(out: RequestOutput) -> None:
            self.final[i] = out
            self.state.metrics.observe_finished(out, self.label)

        return on_finish

    async def updates(
        self, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Yield batches of (prompt index, newest cumulative output) until every request has finished.

        Raises EngineDeadError, RequestAbortedError or ValueError (the core refused a request),
        or ClientDisconnected when `disconnected` says the client has gone.
        """
        done = [False] * len(self.streams)
        while not all(done):
            if disconnected is None:
                await self.notify.wait()
            else:
                try:
                    await asyncio.wait_for(self.notify.wait(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await disconnected():
                        raise ClientDisconnected() from None
                    continue
            self.notify.clear()
            batch = []
            for i, stream in enumerate(self.streams):
                if done[i]:
                    continue
                out = stream.take()
                if out is None:
                    continue
                self.last[i] = out
                done[i] = out.finished
                batch.append((i, out))
            if batch:
                yield batch

    def close(self) -> None:
        """Abort what has not finished and give back the tenant's reservation (idempotent)."""
        if self.closed:
            return
        self.closed = True
        state = self.state
        generated = 0
        unfinished = []
        for i, stream in enumerate(self.streams):
            out = self.final[i] or self.last[i]
            tokens = 0 if out is None else sum(len(c.token_ids) for c in out.outputs)
            generated += tokens
            if stream.error is not None:
                state.metrics.tenant_requests.labels(state.metrics.model_name, self.label, "failed").inc()
            elif not stream.finished:
                unfinished.append(stream.request_id)
                prompt_len = len(self.prepared[i][0].prompt_token_ids)
                state.metrics.observe_aborted(self.label, prompt_len, tokens)
        if unfinished and state.client is not None:
            state.client.abort(unfinished)
        if self.admitted and self.tenant is not None:
            state.tenants.release(self.tenant, len(self.prepared), generated)


def error_for(exc: BaseException) -> OpenAIError:
    """The HTTP error for what `EngineCall.updates` raised."""
    if isinstance(exc, EngineDeadError):
        return OpenAIError(500, f"the engine failed: {exc}", code="engine_dead")
    if isinstance(exc, RequestAbortedError):
        return OpenAIError(503, str(exc), code="aborted")
    if isinstance(exc, ValueError):
        return bad_request(exc)
    return OpenAIError(500, f"internal error: {exc}")


def token_text(lp: Logprob, fallback: str) -> str:
    return lp.decoded_token if lp.decoded_token is not None else fallback


def sampled_and_top(entry: dict[int, Logprob], token: int) -> tuple[Logprob, list[tuple[int, Logprob]]]:
    """The sampled token's logprob and the top alternatives in rank order."""
    sampled = entry.get(token) or Logprob(float("nan"))
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return sampled, ranked
