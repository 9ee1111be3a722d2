"""`tandem serve`: the FastAPI app, its routes, and the server's lifecycle.

This process does HTTP, tokenization, detokenization and metrics; the engine core runs in a
spawned process (`tandem.engine.core_proc`) behind `AsyncEngineClient`. Exit codes: 0 after a
clean shutdown (SIGTERM/SIGINT drain), 1 when the engine process died or failed to start.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at run time.
import argparse
import asyncio
import gc
import logging
import signal
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import Match

from tandem import __version__
from tandem.cluster.build import EngineHooks, start_engines
from tandem.cluster.config import ClusterConfig
from tandem.config import EngineConfig
from tandem.engine.tokenizer import load_chat_template
from tandem.entrypoints.openai import protocol as p
from tandem.entrypoints.openai.errors import OpenAIError, bad_request, validation_error
from tandem.entrypoints.openai.generation_config import sampling_defaults
from tandem.entrypoints.openai.serving import MAX_BODY_OBJECT_MEMBERS, ServerState, started
from tandem.entrypoints.openai.serving_chat import chat_prompt_ids, create_chat_completion
from tandem.entrypoints.openai.serving_completions import create_completion
from tandem.entrypoints.openai.tenants import Tenant, check_admin_key
from tandem.entrypoints.openai.tokenizer_info import tokenizer_info

logger = logging.getLogger("tandem.server")


def build_app(
    state: ServerState, config: EngineConfig, cluster: ClusterConfig | None = None, freeze_gc: bool = False
) -> Any:
    """The FastAPI app; `freeze_gc` (the server process, not an embedding one) keeps what start-up
    built out of the garbage collector's reach once the engine is ready."""

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        state.loop = asyncio.get_running_loop()
        state.metrics.track_admission(
            lambda: state.client.num_inflight if state.client else 0,
            lambda: state.client.num_waiting if state.client else 0,
            lambda: state.connections.total,
        )
        hooks = EngineHooks(
            on_stats=lambda instance, stats: state.metrics.observe_stats(stats, instance),
            on_dead=state.engine_died,
            on_migrated=state.metrics.observe_migration,
            on_gone=state.metrics.forget_instance,
            metrics=state.metrics,
        )
        engines = await start_engines(config, cluster, hooks)  # the cluster's composition: cluster/build.py
        state.client, state.migrator = engines.client, engines.migrator
        try:
            logger.info(
                "engine core process pid=%d ready; serving model %r",
                state.client.engine_pid,
                state.model_name,
            )
            if freeze_gc:
                # ~320k start-up objects (imports, tokenizer): a full collection over them took
                # ~115 ms, every stream's tokens held for it.
                gc.collect()
                gc.freeze()
            yield
        finally:
            await engines.close()

    app = FastAPI(title="tandem", version=__version__, lifespan=lifespan, redoc_url=None)

    def error_response(exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}"))

    async def authenticate(request: Request) -> Tenant | None:
        return state.tenants.authenticate(request.headers.get("authorization"))

    TenantDep = Annotated[Tenant | None, Depends(authenticate)]

    def respond(result: Any) -> Any:
        if result is None:  # the client went away
            return Response(status_code=499)
        if isinstance(result, Response):  # a stream
            return result
        return JSONResponse(result.model_dump())

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request, t: TenantDep) -> Any:
        return respond(await create_completion(state, body, t, request.receive))

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request, t: TenantDep) -> Any:
        return respond(await create_chat_completion(state, body, t, request.receive))

    async def authorize_admin(request: Request) -> None:
        check_admin_key(request.headers.get("authorization"), state.admin_api_key)

    # Operator routes take the operator's key, never a tenant's (a drain shuts an instance down).
    @app.post("/admin/instances/{instance}/drain", dependencies=[Depends(authorize_admin)])
    async def drain(instance: int) -> Any:
        """Scale in: move every request off an engine instance (live migration), then shut it down."""
        if state.migrator is None:
            raise OpenAIError(404, "this server runs one engine instance (no cluster to drain)")
        try:
            seconds = await state.migrator.drain(instance)
        except ValueError as exc:
            raise OpenAIError(409, str(exc)) from None
        except TimeoutError as exc:
            raise OpenAIError(503, str(exc)) from None
        return {"instance": instance, "drained": True, "seconds": round(seconds, 3)}

    def model_card(name: str) -> p.ModelCard:
        limits = state.client.limits if state.client is not None else None
        # `root` is the served name, never the checkpoint's path: no filesystem path leaves the server.
        return p.ModelCard(
            id=name, root=state.model_name, max_model_len=limits.max_model_len if limits else None
        )

    @app.get("/v1/models")
    async def models(t: TenantDep) -> Any:
        names = (state.model_name, *state.extra_model_names)
        return p.ModelList(data=[model_card(n) for n in names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, t: TenantDep) -> Any:
        state.check_model(model_id)
        return model_card(model_id).model_dump()

    @app.get("/version")
    async def version() -> Any:
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Any:
        # vLLM's (SageMaker's) liveness route: the same answer as /health.
        return await health()

    @app.get("/health")
    async def health() -> Any:
        # What a load balancer needs, no more: no pid, no reason beyond one word.
        client = state.client
        if client is None or client.inputs is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if client.dead is not None:
            return JSONResponse({"status": "error"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Any:
        state.authorize_metrics(request.headers.get("authorization"))
        content, media_type = state.metrics.render()
        return Response(content, media_type=media_type)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest, t: TenantDep) -> Any:
        state.check_model(body.model)
        engine = state.engine
        if body.messages is not None and body.prompt is None:
            ids = await chat_prompt_ids(
                state,
                body.messages,
                body.add_generation_prompt and not body.continue_final_message,
                body.tools,
                body.continue_final_message,
                body.chat_template_kwargs,
            )
        elif body.prompt is not None and body.messages is None:
            try:
                started(engine.inputs).check_prompt_text(body.prompt)
                ids = await state.offload(
                    len(body.prompt), started(engine.tokenizer).encode, body.prompt, body.add_special_tokens
                )
            except ValueError as exc:
                raise bad_request(exc, "prompt") from exc
        else:
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        strs = None
        if body.return_token_strs:
            strs = list(started(engine.tokenizer).hf.convert_ids_to_tokens(ids))
        return p.TokenizeResponse(
            count=len(ids), max_model_len=started(engine.limits).max_model_len, tokens=ids, token_strs=strs
        ).model_dump()

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(t: TenantDep) -> Any:
        return tokenizer_info(started(state.engine.tokenizer))

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest, t: TenantDep) -> Any:
        state.check_model(body.model)
        engine = state.engine
        vocab = started(engine.limits).vocab_size
        bad = [x for x in body.tokens if not 0 <= x < vocab]
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        text = await state.offload(len(body.tokens), started(engine.tokenizer).decode, body.tokens, False)
        return p.DetokenizeResponse(prompt=text).model_dump()

    # The routes a tenant's key opens: the guard checks that key from the headers, before the body.
    keyed = [r for r in app.routes if isinstance(r, APIRoute) and _depends_on(r.dependant, authenticate)]
    return GuardMiddleware(app, state, keyed)


def _depends_on(dependant: Any, call: Any) -> bool:
    return any(d.call is call or _depends_on(d, call) for d in dependant.dependencies)


class BodyError(Exception):
    def __init__(self, error: OpenAIError) -> None:
        self.error = error


class GuardMiddleware:
    """ASGI guard in front of the app.

    Generation while draining gets 503. A route that takes a tenant's key (`keyed_routes`) gets its
    401 from the headers, before any of the body is read (an unauthenticated client costs no upload
    and no parsing). A request body is read here, whole, before the app sees it:
    past `max_body_bytes` (counted as read, so a chunked upload cannot pass it) it gets 413, and one
    that has not arrived within `body_timeout_s` gets 408. The app then reads the buffered body, and
    afterwards the connection's own messages (a disconnect).
    """

    def __init__(self, app: Any, state: ServerState, keyed_routes: Sequence[Any] = ()) -> None:
        self.app = app
        self.state = state
        self.keyed_routes = keyed_routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        try:
            if state.draining and scope["method"] == "POST":
                raise BodyError(OpenAIError(503, "the server is shutting down", headers={"Retry-After": "5"}))
            self._authenticate(scope)
            for name, value in scope.get("headers", ()):
                if name == b"content-length" and (not value.isdigit() or int(value) > state.max_body_bytes):
                    raise BodyError(self._too_large())
            body = await asyncio.wait_for(self._read_body(receive), state.body_timeout_s)
        except BodyError as exc:
            await self._reject(exc.error, scope, receive, send)
            return
        except asyncio.TimeoutError:
            err = OpenAIError(408, "the request body took too long to arrive", code="timeout")
            await self._reject(err, scope, receive, send)
            return
        if body is None:  # the client left while sending
            return
        if _object_members(body) > MAX_BODY_OBJECT_MEMBERS:
            err = OpenAIError(
                413, f"the request body has more than {MAX_BODY_OBJECT_MEMBERS} JSON object members"
            )
            await self._reject(err, scope, receive, send)
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authenticate(self, scope: Any) -> None:
        tenants = self.state.tenants
        if not tenants.enabled or all(r.matches(scope)[0] == Match.NONE for r in self.keyed_routes):
            return
        headers = scope.get("headers", ())
        authorization = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
        try:
            tenants.authenticate(authorization)
        except OpenAIError as exc:
            raise BodyError(exc) from None

    async def _read_body(self, receive: Any) -> bytes | None:
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.state.max_body_bytes:
                raise BodyError(self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than {self.state.max_body_bytes} bytes")

    @staticmethod
    async def _reject(err: OpenAIError, scope: Any, receive: Any, send: Any) -> None:
        # The rest of the body is not read: the connection closes after the answer.
        headers = {**(err.headers or {}), "Connection": "close"}
        await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


def _object_members(body: bytes) -> int:
    """How many members a JSON body's objects have, read off the bytes (a key's closing quote then
    its colon): colons are counted first, a pass over memory, and the members only if there could
    be too many (colons in strings count there, never below the members)."""
    if body.count(b":") <= MAX_BODY_OBJECT_MEMBERS:
        return 0
    return body.count(b'":') + body.count(b'" :')


def _make_server(config: Any, state: ServerState) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing at once."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = state.loop
            if state.draining or not self.started or loop is None:
                if state.draining and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(drain(self, state)))

    return Server(config)


async def drain(server: Any, state: ServerState) -> None:
    """Stop accepting (503), let in-flight requests finish within the drain timeout, abort the rest, exit."""
    if state.draining:
        return
    state.draining = True
    client = state.client
    logger.info(
        "draining: %d request(s) in flight, up to %.1fs",
        client.num_inflight if client else 0,
        state.drain_timeout,
    )
    deadline = time.monotonic() + state.drain_timeout
    while client is not None and client.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client is not None and client.num_inflight:
        logger.info("drain timeout: aborting %d request(s)", client.num_inflight)
        client.abort_all("the server shut down before the request finished")
    await asyncio.sleep(0.2)  # let the last responses go out
    server.should_exit = True


def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    import uvicorn

    from tandem.entrypoints.cli import cluster_kwargs
    from tandem.entrypoints.openai.connections import (
        ConnectionLimits,
        ConnectionTable,
        guarded_protocol,
        http_implementation,
    )
    from tandem.entrypoints.openai.metrics import ServerMetrics
    from tandem.entrypoints.openai.tenants import Tenants

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be at least 1, got {args.max_waiting_requests}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be non-negative, got {args.drain_timeout}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be positive, got {args.max_request_body_bytes}")
    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be positive, got {args.body_timeout}")
    # One client may usefully hold as many connections as the server queues and runs requests.
    useful = args.max_waiting_requests + config.max_num_seqs
    limits = ConnectionLimits(
        max_connections=args.max_connections or max(1024, 2 * useful),
        max_per_client=useful if args.max_connections_per_client is None else args.max_connections_per_client,
        header_timeout_s=args.header_timeout,
    )
    # Counted connections, as many refused ones being answered 503, and the process's own files.
    _raise_open_files_limit(2 * limits.max_connections + 256)
    enable_auto_tools = getattr(args, "enable_auto_tool_choice", False)
    tool_parser = getattr(args, "tool_call_parser", None)
    if enable_auto_tools and tool_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    tenants = Tenants.from_args(args.api_key, args.api_keys_file)
    names = args.served_model_name or [Path(config.model).name]
    name = names[0]
    state = ServerState(
        model_name=name,
        # (model_aliases: what `tandem serve` was given when it named a GGUF file or a pulled model.)
        model_aliases=frozenset({config.model, *names[1:], *getattr(args, "model_aliases", ())}),
        extra_model_names=tuple(n for n in dict.fromkeys(names[1:]) if n != name),
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        max_logprobs=args.max_logprobs,
        response_role=args.response_role,
        sampling_defaults=sampling_defaults(args.generation_config, config.model),
        chat_template=chat_template,
        tool_parser=tool_parser if enable_auto_tools else None,
        metrics=ServerMetrics(name),
        tenants=tenants,
        max_waiting_requests=args.max_waiting_requests,
        drain_timeout=args.drain_timeout,
        max_body_bytes=args.max_request_body_bytes,
        body_timeout_s=args.body_timeout,
        connections=ConnectionTable(limits),
        metrics_api_key=args.metrics_api_key,
        metrics_on_api_port=args.metrics_port is None,
        admin_api_key=args.admin_api_key,
    )
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host, registry=state.metrics.registry)
    cluster = None
    disaggregated = args.prefill_instances > 0 or args.decode_instances > 0
    if disaggregated:
        args.num_instances = args.prefill_instances + args.decode_instances
    if args.num_instances > 1 or args.ray_address is not None or disaggregated:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError(
                "--num-instances > 1 and --ray-address need Ray: pip install 'tandem[cluster]'"
            ) from None
        cluster = ClusterConfig(**cluster_kwargs(args, config.num_threads))
    app = build_app(state, config, cluster, freeze_gc=True)
    logger.info("HTTP parser: %s", http_implementation())
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        http=guarded_protocol(state.connections),
    )
    server = _make_server(uv_config, state)

    def request_exit() -> None:
        server.should_exit = True

    state.request_exit = request_exit
    server.run()
    if not server.started:
        return 1
    return state.exit_code


def _raise_open_files_limit(wanted: int) -> None:
    """Let the process hold `wanted` descriptors (one per connection), up to the hard limit."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
