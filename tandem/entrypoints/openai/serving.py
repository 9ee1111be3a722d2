"""What completions and chat share: server state, sampling parameters, admission, following outputs."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from tandem.engine.core_client import (
    AsyncEngineClient,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    RequestStream,
)
from tandem.engine.messages import EngineCoreRequest
from tandem.engine.token_controls import tokenize_bad_words
from tandem.entrypoints.openai.connections import ConnectionLimits, ConnectionTable
from tandem.entrypoints.openai.errors import OpenAIError, bad_request
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.protocol import PromptTokensDetails, SamplingFields, UsageInfo
from tandem.entrypoints.openai.tenants import Tenant, Tenants
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sampling_params import MAX_LOGPROBS, MAX_TOKEN_CONTROLS, RequestOutputKind, SamplingParams

T = TypeVar("T")


def _engine_starting() -> OpenAIError:
    return OpenAIError(503, "the engine is starting", code="engine_starting", headers={"Retry-After": "1"})


def started(value: T | None) -> T:
    """A field of the engine client that its start() sets (limits, tokenizer, inputs). None only
    before then, and `ServerState.engine` lets no request past until then: a 503 all the same."""
    if value is None:
        raise _engine_starting()
    return value

# Prompts bigger than this (characters, or token ids) are tokenized and validated off the event
# loop, so one large request never stalls the server's other requests.
INLINE_PROMPT_SIZE = 16 << 10
# A request body with more JSON object members than this is refused (413) before it is parsed: the
# parse runs on the event loop, holding the GIL, at about 0.7 us a member (a logit_bias of a million
# entries held every client, /health too, for 0.7-3 s). Token-id lists are arrays, not members.
MAX_BODY_OBJECT_MEMBERS = 1 << 16


@dataclass
class ServerState:
    """Everything one server instance holds (no module-level state)."""

    model_name: str
    metrics: ServerMetrics
    tenants: Tenants
    max_waiting_requests: int
    drain_timeout: float
    # Other names clients may send for the model (the checkpoint path it was started with, and
    # the --served-model-name names after the first, which /v1/models lists too).
    model_aliases: frozenset[str] = frozenset()
    # --chat-template (None: the tokenizer's), and the --tool-call-parser that reads tool_choice
    # "auto" output (None without --enable-auto-tool-choice).
    chat_template: str | None = None
    tool_parser: str | None = None
    extra_model_names: tuple[str, ...] = ()
    # --return-tokens-as-token-ids, --max-logprobs, --response-role, and the sampling defaults
    # --generation-config read (vLLM's names: temperature, top_p, top_k, min_p, repetition_penalty,
    # max_tokens).
    return_tokens_as_token_ids: bool = False
    max_logprobs: int = MAX_LOGPROBS
    response_role: str = "assistant"
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = 30.0
    connections: ConnectionTable = field(default_factory=lambda: ConnectionTable(ConnectionLimits()))
    # /metrics: the key it needs, and whether the API port serves it at all (not with --metrics-port).
    metrics_api_key: str | None = None
    metrics_on_api_port: bool = True
    # --admin-api-key: the operator routes' key (draining an instance); None turns them off.
    admin_api_key: str | None = None
    client: AsyncEngineClient | None = None
    # The cluster's migration policy and drains (tandem.cluster.migrator.Migrator), with --num-instances > 1.
    migrator: Any = None
    draining: bool = False
    exit_code: int = 0
    request_exit: Callable[[], None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    # Tokenization and detokenization of large inputs run here, off the event loop.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tandem-tokenize")
    )
    # Whether the chat template renders `tools` (None: not looked at yet; serving_chat finds out at
    # the first request with tools, and warns when it does not).
    template_takes_tools: bool | None = None
    # Structured-output specs wait here for their check process (tandem/structured/checker.py), so a
    # slow spec never holds up tokenization.
    grammar_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tandem-grammar-check")
    )

    async def offload(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), in the tokenizer threads when `size` (characters or tokens) is large."""
        if size <= INLINE_PROMPT_SIZE:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @property
    def engine(self) -> AsyncEngineClient:
        if self.client is None or self.client.inputs is None:
            raise _engine_starting()
        if self.client.dead is not None:
            raise OpenAIError(500, f"the engine is not running: {self.client.dead}", code="engine_dead")
        return self.client

    def authorize_metrics(self, authorization: str | None) -> None:
        """/metrics shows every tenant's name and counts: under API keys it needs its own key."""
        if not self.metrics_on_api_port:
            raise OpenAIError(404, "metrics are served on the metrics port")
        if self.metrics_api_key is None:
            if self.tenants.enabled:
                raise OpenAIError(
                    401,
                    "/metrics needs --metrics-api-key (or --metrics-port) on a server with API keys",
                    "authentication_error",
                )
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.metrics_api_key.encode()):
            raise OpenAIError(401, "invalid or missing metrics key", "authentication_error")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.model_aliases:
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


def logit_bias(body: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings as keys) with integer keys; 400 for a key that is not one."""
    if not body.logit_bias:
        return None
    # The count first: no entry is looked at in a map too large to be used (the request model
    # bounds it too; this keeps callers that build bodies in process to the same bound).
    if len(body.logit_bias) > MAX_TOKEN_CONTROLS:
        raise bad_request(
            f"logit_bias holds {len(body.logit_bias)} entries, more than {MAX_TOKEN_CONTROLS}", "logit_bias"
        )
    out = {}
    for key, value in body.logit_bias.items():
        if not key.strip().isdigit():
            raise bad_request(f"logit_bias keys must be token ids (decimal strings), got {key[:50]!r}", "logit_bias")
        out[int(key)] = value
    return out


def sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    state: ServerState | None = None,
    n: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's parameters for a request. With the server's `state`: its --generation-config
    defaults fill the fields the request leaves unset, and --max-logprobs bounds logprobs; `n`
    overrides the request's (best_of); `prompt_logprobs` the body's (completions' echo asks for
    them with `logprobs`)."""
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs are not available with stream", "prompt_logprobs")
    d = state.sampling_defaults if state is not None else {}

    def pick(value: Any, name: str, fallback: Any) -> Any:
        return value if value is not None else d.get(name, fallback)

    if state is not None and logprobs is not None and logprobs > state.max_logprobs:
        raise bad_request(
            f"logprobs: {logprobs} is more than this server allows (--max-logprobs {state.max_logprobs})",
            "logprobs",
        )
    if max_tokens is None:
        max_tokens = d.get("max_tokens")
    from tandem.entrypoints.openai.structured import structured_outputs

    constraint = structured_outputs(body)
    try:
        return SamplingParams(
            n=body.n if n is None else n,
            temperature=pick(body.temperature, "temperature", 1.0),
            top_p=pick(body.top_p, "top_p", 1.0),
            top_k=pick(body.top_k, "top_k", 0),
            min_p=pick(body.min_p, "min_p", 0.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=pick(body.repetition_penalty, "repetition_penalty", 1.0),
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=constraint,
            logit_bias=logit_bias(body),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            # Streamed or not, the engine hands over what is new (`OutputSoFar` keeps the whole for
            # a response): each output then costs what it holds, not the length so far. Nothing
            # until the end (vLLM's FINAL_ONLY) would hide a running request's progress from the
            # admission count and the tenant's token charge.
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:
        raise bad_request(exc) from exc


def prompt_size(prompt: Any) -> int:
    """Characters or token ids in a prompt (a string, a list of ids, or a dict holding either)."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt", ""))
    return len(prompt) if isinstance(prompt, (str, list)) else 0


async def prepare(
    state: ServerState,
    base_id: str,
    prompts: list[Any],
    params: SamplingParams,
    body: SamplingFields,
    tenant: Tenant | None,
    prompt_params: list[SamplingParams] | None = None,
) -> list[tuple[EngineCoreRequest, str | None]]:
    """Tokenize and validate every prompt (400 on any problem) before anything is queued;
    `prompt_params` (one per prompt) replace `params` for the prompts they differ for.

    The queue bound is checked first, so an overloaded server turns requests away before spending
    time on them; the caller starts the `EngineCall` right after (the bound may be passed by the
    requests tokenized meanwhile, by at most their number).
    """
    engine = state.engine
    if state.draining:
        raise OpenAIError(503, "the server is shutting down", headers={"Retry-After": "5"})
    n = len(prompts)
    if n > state.max_waiting_requests:
        raise bad_request(
            f"{n} prompts is more than this server queues ({state.max_waiting_requests})", "prompt"
        )
    check_queue(state, tenant, n)
    priority = tenant.priority if tenant is not None and tenant.priority is not None else body.priority
    # The bad words are tokenized twice each (as written and after a space), once for the request.
    size = sum(prompt_size(p) for p in prompts) + 2 * sum(len(w) for w in params.bad_words or ())
    if params.structured_outputs is not None:
        from tandem.entrypoints.openai.structured import check_constraint

        await check_constraint(state.grammar_executor, started(engine.inputs), params, body)
        # Off the event loop even for a short prompt: the processor looks the spec's verdict up
        # again, and should it have been dropped meanwhile, checks it anew.
        size = max(size, INLINE_PROMPT_SIZE + 1)

    def process_all() -> list[tuple[EngineCoreRequest, str | None]]:
        tokenizer = started(engine.tokenizer)
        try:
            # The processor leaves words already tokenized alone: not once more per prompt.
            shared = tokenize_bad_words(params, lambda w: tokenizer.encode(w, add_special_tokens=False))
        except ValueError as exc:
            raise bad_request(exc, "bad_words") from exc
        out = []
        for i, prompt in enumerate(prompts):
            own = params if prompt_params is None else prompt_params[i]
            try:
                out.append(
                    started(engine.inputs).process(
                        f"{base_id}-{i}",
                        prompt,
                        shared if own is params else own,
                        priority=priority,
                        tenant=None if tenant is None else tenant.name,
                        cache_salt=request_salt(tenant, body.cache_salt),
                    )
                )
            except ValueError as exc:
                raise bad_request(exc, "prompt" if len(prompts) > 1 and "prompt" in str(exc) else None) from exc
        return out

    return await state.offload(size, process_all)


def request_salt(tenant: Tenant | None, salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its tenant's, then the body's `cache_salt` within it (a
    request can keep its prefix to itself, never reach into another tenant's). Within a tenant the
    body's salt is digested, so the result stays within the engine's salt bound whatever it was."""
    if tenant is None:
        return salt
    if salt is None:
        return tenant.cache_salt
    return f"{tenant.cache_salt}\x00{hashlib.sha256(salt.encode()).hexdigest()}"


def check_queue(state: ServerState, tenant: Tenant | None, n: int) -> None:
    """503 when `n` more requests would take the accepted-but-not-started count past the bound."""
    engine = state.engine
    if engine.num_waiting + n > state.max_waiting_requests:
        state.metrics.observe_rejected(tenant_label(tenant))
        raise OpenAIError(
            503,
            f"the server is overloaded ({engine.num_waiting} requests waiting); retry later",
            code="overloaded",
            headers={"Retry-After": "1"},
        )


class ClientDisconnected(Exception):
    pass


@dataclass(slots=True)
class _SampleSoFar:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    text: list[str] = field(default_factory=list)
    num_chars: int = 0
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OutputSoFar:
    """One engine request's outputs as read so far. Each output read, cumulative or delta, becomes
    a delta (what a streaming response sends), and the whole is kept for a response sent at the
    end; a delta costs what it holds (a cumulative one is compared with what came before)."""

    def __init__(self) -> None:
        self.samples: dict[int, _SampleSoFar] = {}
        self.latest: RequestOutput | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples.values())

    @property
    def started(self) -> bool:
        """A token has come, or a sample has ended."""
        return any(s.token_ids or s.finish_reason is not None for s in self.samples.values())

    def add(self, out: RequestOutput) -> RequestOutput:
        """Take the next output in; returns what it adds, as a delta."""
        deltas = []
        for c in out.outputs:
            s = self.samples.get(c.index)
            if s is None:
                s = self.samples[c.index] = _SampleSoFar(c.index)
            if out.delta:
                ids, logprobs, text = c.token_ids, c.logprobs, c.text
            else:
                ids = c.token_ids[len(s.token_ids) :]
                logprobs = None if c.logprobs is None else c.logprobs[len(s.logprobs or ()) :]
                text = c.text[s.num_chars :]
            s.token_ids += ids
            if logprobs is not None:
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs += logprobs
            if text:
                s.text.append(text)
                s.num_chars += len(text)
            s.cumulative_logprob, s.finish_reason, s.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
            deltas.append(replace(c, text=text, token_ids=ids, logprobs=logprobs))
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        view = replace(out, outputs=deltas, delta=True)
        self.latest = view
        return view

    def whole(self) -> RequestOutput:
        """Everything read, as one cumulative output (the last output's state and metrics)."""
        if self.latest is None:
            raise RuntimeError("no output has been read")
        samples = [
            CompletionOutput(
                index=s.index,
                text="".join(s.text),
                token_ids=s.token_ids,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in sorted(self.samples.values(), key=lambda s: s.index)
        ]
        return replace(self.latest, outputs=samples, prompt_logprobs=self.prompt_logprobs, delta=False)


class EngineCall:
    """The engine requests of one HTTP request: admitted together, followed together, ended together.

    Use it as a context manager around everything after `prepare`: leaving the block by any path
    (an error, a return, a cancelled task) ends the engine requests and gives back the admission
    slot and the tenant's reservation, unless the call was handed to a streaming response with
    `stream_to`, which then ends it when the stream ends.
    """

    def __init__(
        self,
        state: ServerState,
        tenant: Tenant | None,
        prepared: list[tuple[EngineCoreRequest, str | None]],
        unsent_prompt_tokens: int = 0,
    ) -> None:
        self.state = state
        self.tenant = tenant
        # Prompt tokens the engine is not sent but the client did send (a scored prompt's last
        # token, which the engine generates instead): usage and the tenant's quota count them.
        self.unsent_prompt_tokens = unsent_prompt_tokens
        self.label = tenant_label(tenant)
        self.prepared = prepared
        self.notify = asyncio.Event()
        self.streams: list[RequestStream] = []
        # Per prompt: what the caller has read, and the final output as it arrived from the engine.
        self.so_far = [OutputSoFar() for _ in prepared]
        self.final: list[RequestOutput | None] = [None] * len(prepared)
        self.admitted = False
        # Generated tokens charged to the tenant so far, per prompt (charged as they arrive).
        self.charged = [0] * len(prepared)
        self.closed = False
        self.handed_off = False
        self.client_gone = False
        self._watcher: asyncio.Task | None = None

    def __enter__(self) -> EngineCall:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.handed_off:
            self.close()

    def stream_to(self, make_response: Callable[[EngineCall], Any]) -> Any:
        """Hand the call to a streaming response (built by `make_response(self)`), which closes it."""
        response = make_response(self)
        self.handed_off = True
        return response

    @property
    def num_seqs(self) -> int:
        """Sequences the call runs: every sample of every prompt (n, or best_of), each a seat."""
        return sum(req.params.n for req, _ in self.prepared)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(req.prompt_token_ids) for req, _ in self.prepared) + self.unsent_prompt_tokens

    def usage(self, completion_tokens: int) -> UsageInfo:
        """Token counts, with the prompt tokens the engine found in its prefix cache."""
        latest = [s.latest for s in self.so_far]
        cached = sum(o.metrics.num_cached_tokens for o in latest if o is not None and o.metrics is not None)
        prompt_tokens = self.num_prompt_tokens
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def start(self) -> None:
        """Admit (tenant limits: 429) and queue; the caller has `prepare`d (queue bound: 503) just before."""
        state, engine = self.state, self.state.engine
        check_queue(state, self.tenant, len(self.prepared))
        if self.tenant is not None:
            try:
                state.tenants.admit(self.tenant, self.num_seqs, self.num_prompt_tokens)
            except OpenAIError:
                state.metrics.observe_rejected(self.label)
                raise
        self.admitted = True
        try:
            for i, (req, text) in enumerate(self.prepared):
                self.streams.append(engine.add(req, text, self.notify, self._finisher(i)))
        except EngineDeadError as exc:
            raise OpenAIError(500, f"the engine is not running: {exc}", code="engine_dead") from exc
        except ValueError as exc:
            raise bad_request(exc) from exc

    def watch(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Follow the HTTP connection: a disconnect wakes `updates` at once (it then raises)."""

        async def watcher() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.client_gone = True
                    self.notify.set()
                    return

        self._watcher = asyncio.ensure_future(watcher())

    def outputs(self) -> list[RequestOutput]:
        """The whole outputs, once `finish` has returned True (every request has finished)."""
        if any(s.latest is None for s in self.so_far):
            raise RuntimeError("the engine call has not finished")
        return [s.whole() for s in self.so_far]

    async def finish(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> bool:
        """Wait until every request has finished (a non-streaming response). False if the client
        went away first; an engine error becomes the HTTP error for it."""
        self.watch(receive)
        try:
            async for _ in self.updates():
                pass
        except ClientDisconnected:
            return False
        except (RuntimeError, ValueError) as exc:
            raise error_for(exc) from exc
        return True

    def _finisher(self, i: int) -> Callable[[RequestOutput], None]:
        def on_finish(out: RequestOutput) -> None:
            self.final[i] = out
            self.state.metrics.observe_finished(out, self.label)

        return on_finish

    async def updates(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Yield batches of (prompt index, what its request's outputs added since the last batch, as
        a delta output) until every request has finished; `so_far` holds the whole.

        Raises EngineDeadError, RequestAbortedError, RequestFailedError or ValueError (the core
        refused a request), or ClientDisconnected once `watch` has seen the client go.
        """
        done = [False] * len(self.streams)
        while not all(done):
            await self.notify.wait()
            self.notify.clear()
            if self.client_gone:
                raise ClientDisconnected()
            batch = []
            for i, stream in enumerate(self.streams):
                if done[i]:
                    continue
                out = stream.take()
                if out is None:
                    continue
                added = self.so_far[i].add(out)
                self._charge(i)
                done[i] = out.finished
                batch.append((i, added))
            if batch:
                yield batch

    def _charge(self, i: int) -> None:
        """Charge the tenant for prompt i's tokens generated since the last output, as they come:
        a running request holds back its tenant's next admission at once, not only when it ends."""
        if self.tenant is None or not self.admitted:
            return
        tokens = self.so_far[i].num_tokens
        if tokens > self.charged[i]:
            self.state.tenants.charge(self.tenant, tokens - self.charged[i])
            self.charged[i] = tokens

    def close(self) -> None:
        """Abort what has not finished and give back the tenant's reservation (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        state = self.state
        generated = 0
        try:
            for i, stream in enumerate(self.streams):
                final = self.final[i]
                tokens = max(self.so_far[i].num_tokens, 0 if final is None else final.num_generation_tokens)
                generated += tokens
                if stream.error is not None:
                    state.metrics.observe_failed(self.label)
                elif not stream.finished:
                    prompt_len = len(self.prepared[i][0].prompt_token_ids)
                    state.metrics.observe_aborted(self.label, prompt_len, tokens)
        finally:
            if state.client is not None:
                # Every stream, finished or not: a failed or aborted one may still be registered.
                state.client.abort([s.request_id for s in self.streams])
            if self.admitted and self.tenant is not None:
                state.tenants.release(self.tenant, self.num_seqs, generated - sum(self.charged))


def error_for(exc: BaseException) -> OpenAIError:
    """The HTTP error for what `EngineCall.updates` raised."""
    if isinstance(exc, EngineDeadError):
        return OpenAIError(500, str(exc), code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return OpenAIError(500, f"the request failed in the engine: {exc}", code="request_failed")
    if isinstance(exc, RequestAbortedError):
        return OpenAIError(503, str(exc), code="aborted")
    if isinstance(exc, ValueError):
        return bad_request(exc)
    return OpenAIError(500, f"internal error: {exc}")


@dataclass(frozen=True)
class TokenText:
    """How a logprob's token is written: its text, or `token_id:N` (return_tokens_as_token_ids,
    for tokens whose text is not valid UTF-8 on its own)."""

    decode: Callable[[int], str]
    as_ids: bool = False

    def __call__(self, token: int, lp: Logprob | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.decode(token)


def sampled_and_top(entry: dict[int, Logprob], token: int) -> tuple[Logprob, list[tuple[int, Logprob]]]:
    """The sampled token's logprob and the top alternatives in rank order."""
    sampled = entry.get(token) or Logprob(float("nan"))
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return sampled, ranked
