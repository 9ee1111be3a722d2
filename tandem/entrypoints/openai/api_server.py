"""`tandem serve`: the FastAPI app, its routes, and the server's lifecycle.

This process does HTTP, tokenization, detokenization and metrics; the engine core runs in a
spawned process (`tandem.engine.core_proc`) behind `AsyncEngineClient`. Exit codes: 0 after a
clean shutdown (SIGTERM/SIGINT drain), 1 when the engine process died or failed to start.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at run time.
import argparse
import asyncio
import logging
import signal
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from tandem.config import EngineConfig
from tandem.engine.core_client import AsyncEngineClient
from tandem.entrypoints.openai import protocol as p
from tandem.entrypoints.openai.errors import OpenAIError, bad_request, validation_error
from tandem.entrypoints.openai.serving import ServerState
from tandem.entrypoints.openai.serving_chat import chat_prompt_ids, create_chat_completion
from tandem.entrypoints.openai.serving_completions import create_completion
from tandem.entrypoints.openai.tenants import Tenant

logger = logging.getLogger("tandem.server")

MAX_BODY_BYTES = 32 << 20


def build_app(state: ServerState, config: EngineConfig) -> Any:
    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        state.loop = asyncio.get_running_loop()
        state.client = AsyncEngineClient(
            config, on_stats=state.metrics.observe_stats, on_dead=state.engine_died
        )
        try:
            await state.client.start()
            logger.info(
                "engine core process pid=%d ready; serving model %r",
                state.client.engine_pid,
                state.model_name,
            )
            yield
        finally:
            await state.client.shutdown()

    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

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
        return respond(await create_completion(state, body, t, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request, t: TenantDep) -> Any:
        return respond(await create_chat_completion(state, body, t, request.is_disconnected))

    @app.get("/v1/models")
    async def models(t: TenantDep) -> Any:
        limits = state.client.limits if state.client is not None else None
        card = p.ModelCard(
            id=state.model_name, root=state.model_path, max_model_len=limits.max_model_len if limits else None
        )
        return p.ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> Any:
        client = state.client
        pid = client.engine_pid if client is not None else None
        if client is None or client.dead is not None:
            reason = client.dead if client is not None else "starting"
            return JSONResponse({"status": "error", "reason": reason, "engine_pid": pid}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", "engine_pid": pid}, status_code=503)
        return {"status": "ok", "engine_pid": pid}

    @app.get("/metrics")
    async def metrics() -> Any:
        content, media_type = state.metrics.render()
        return Response(content, media_type=media_type)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest, t: TenantDep) -> Any:
        state.check_model(body.model)
        engine = state.engine
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            ids = chat_prompt_ids(state, body.messages, body.add_generation_prompt)
        else:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return p.TokenizeResponse(
            count=len(ids), max_model_len=engine.limits.max_model_len, tokens=ids
        ).model_dump()

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest, t: TenantDep) -> Any:
        state.check_model(body.model)
        engine = state.engine
        vocab = engine.limits.vocab_size
        bad = [x for x in body.tokens if not 0 <= x < vocab]
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return p.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, False)).model_dump()

    return GuardMiddleware(app, state)


class GuardMiddleware:
    """ASGI guard in front of the app: oversized bodies get 413, generation while draining gets 503."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            err = None
            if self.state.draining and scope["method"] == "POST":
                err = OpenAIError(503, "the server is shutting down", headers={"Retry-After": "5"})
            else:
                for name, value in scope.get("headers", ()):
                    if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY_BYTES:
                        err = OpenAIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            if err is not None:
                await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


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

    from tandem.entrypoints.openai.tenants import Tenants
    from tandem.metrics import ServerMetrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be at least 1, got {args.max_waiting_requests}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be non-negative, got {args.drain_timeout}")
    name = args.served_model_name or config.model
    state = ServerState(
        model_name=name,
        model_path=config.model,
        metrics=ServerMetrics(name),
        tenants=Tenants.from_args(args.api_key, args.api_keys_file),
        max_waiting_requests=args.max_waiting_requests,
        drain_timeout=args.drain_timeout,
    )
    app = build_app(state, config)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        # Connections beyond this get uvicorn's own 503: a hard bound on memory under any burst.
        limit_concurrency=max(256, 2 * (args.max_waiting_requests + config.max_num_seqs)),
        timeout_keep_alive=5,
    )
    server = _make_server(uv_config, state)

    def request_exit() -> None:
        server.should_exit = True

    state.request_exit = request_exit
    server.run()
    if not server.started:
        return 1
    return state.exit_code
