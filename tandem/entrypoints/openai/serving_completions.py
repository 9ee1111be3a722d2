"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from tandem.entrypoints.openai.errors import OpenAIError, bad_request
from tandem.entrypoints.openai.fim import fim_prompt
from tandem.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from tandem.entrypoints.openai.serving import (
    EngineCall,
    ServerState,
    TokenText,
    error_for,
    prepare,
    sampled_and_top,
    sampling_params,
    started,
)
from tandem.entrypoints.openai.sse import SSEResponse
from tandem.entrypoints.openai.tenants import Tenant
from tandem.outputs import CompletionOutput


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _logprobs(c: CompletionOutput, start: int, end: int, offset: int, decode: TokenText) -> tuple[Any, int]:
    """Completion-style logprobs of tokens [start, end) of a sample; returns them and the next text offset."""
    lp = CompletionLogprobs()
    logprobs = c.logprobs or []
    for pos in range(start, min(end, len(logprobs))):
        token = c.token_ids[pos]
        sampled, ranked = sampled_and_top(logprobs[pos], token)
        text = decode(token, sampled)
        lp.tokens.append(text)
        lp.token_logprobs.append(sampled.logprob)
        lp.top_logprobs.append({decode(t, p): p.logprob for t, p in ranked})
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


async def create_completion(
    state: ServerState, body: CompletionRequest, tenant: Tenant | None, receive: Any
) -> Any:
    state.check_model(body.model)
    best_of = body.best_of if body.best_of is not None and body.best_of != body.n else None
    if best_of is not None:
        if best_of < body.n:
            raise bad_request(f"best_of ({best_of}) must be at least n ({body.n})", "best_of")
        if body.stream:
            raise bad_request("best_of > n cannot be streamed (the best are known only at the end)", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported", "echo")
    # best_of ranks samples by cumulative logprob: the engine computes it when logprobs are on.
    gen_logprobs = body.logprobs if body.logprobs is not None or best_of is None else 0
    params = sampling_params(body, body.max_tokens, gen_logprobs, state, n=best_of)
    prompts = _prompts(body.prompt)
    tokenizer = started(state.engine.tokenizer)
    if body.suffix:
        prompts = [_fim(state, tokenizer, p, body.suffix) for p in prompts]
    request_id = random_id("cmpl")
    prepared = await prepare(state, request_id, prompts, params, body, tenant)
    decode = TokenText(tokenizer.decode_token, bool(body.return_tokens_as_token_ids or state.return_tokens_as_token_ids))
    n = params.n
    with EngineCall(state, tenant, prepared) as call:
        echo = None
        if body.echo:
            echo = [
                tokenizer.decode(req.prompt_token_ids, False) if text is None else text
                for req, text in prepared
            ]
        call.start()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return call.stream_to(
                lambda c: SSEResponse(
                    _stream(state, c, request_id, n, echo, body.logprobs is not None, include_usage, decode),
                    c.close,
                )
            )
        if not await call.finish(receive):
            return None  # the client went away
    choices = []
    completion_tokens = 0
    for i, out in enumerate(call.outputs()):
        samples = out.outputs if best_of is None else _best(out.outputs, body.n)
        for c in samples:
            completion_tokens += len(c.token_ids)
            lp = _logprobs(c, 0, len(c.token_ids), 0, decode)[0] if body.logprobs is not None else None
            text = (echo[i] if echo else "") + c.text
            choices.append(
                CompletionChoice(
                    index=i * body.n + c.index,
                    text=text,
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    prompt_tokens = call.num_prompt_tokens
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    return CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage)


def _best(samples: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The `n` samples of highest cumulative logprob, best first, renumbered 0..n-1."""
    ranked = sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
    return [replace(c, index=k) for k, c in enumerate(ranked)]


def _fim(state: ServerState, tokenizer: Any, prompt: Any, suffix: str) -> dict[str, Any]:
    if not isinstance(prompt, str):
        raise bad_request("suffix needs a text prompt, not token ids", "suffix")
    try:
        started(state.engine.inputs).check_prompt_text(prompt + suffix)
        ids = fim_prompt(
            tokenizer.backend.token_to_id, lambda t: tokenizer.encode(t, add_special_tokens=False), prompt, suffix
        )
    except ValueError as exc:
        raise bad_request(exc, "suffix") from exc
    return {"prompt_token_ids": ids, "prompt": prompt}


async def _stream(
    state: ServerState,
    call: EngineCall,
    request_id: str,
    n: int,
    echo: list[str] | None,
    want_logprobs: bool,
    include_usage: bool,
    decode: TokenText,
) -> AsyncIterator[str]:
    created = int(time.time())
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    completion_tokens = 0

    def chunk(choice: CompletionChoice) -> str:
        c = CompletionChunk(id=request_id, created=created, model=state.model_name, choices=[choice])
        return f"data: {c.model_dump_json()}\n\n"

    try:
        if echo:
            for i, text in enumerate(echo):
                for k in range(n):
                    offsets[i * n + k] = len(text)
                    yield chunk(CompletionChoice(index=i * n + k, text=text))
        async for batch in call.updates():
            for i, out in batch:
                for c in out.outputs:
                    key = i * n + c.index
                    if key in sent_tokens and sent_tokens[key] < 0:
                        continue  # already finished
                    start_tok = sent_tokens.get(key, 0)
                    start_txt = sent_text.get(key, 0)
                    delta = c.text[start_txt:] if len(c.text) > start_txt else ""
                    lp = None
                    if want_logprobs and len(c.token_ids) > start_tok:
                        lp, offsets[key] = _logprobs(
                            c, start_tok, len(c.token_ids), offsets.get(key, 0), decode
                        )
                    finished = c.finish_reason is not None
                    if delta or lp is not None or finished:
                        yield chunk(
                            CompletionChoice(
                                index=key,
                                text=delta,
                                logprobs=lp,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                    sent_text[key] = max(start_txt, len(c.text))
                    sent_tokens[key] = -1 if finished else len(c.token_ids)
                    if finished:
                        completion_tokens += len(c.token_ids)
        if include_usage:
            usage = UsageInfo(
                prompt_tokens=call.num_prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=call.num_prompt_tokens + completion_tokens,
            )
            last = CompletionChunk(
                id=request_id, created=created, model=state.model_name, choices=[], usage=usage
            )
            yield f"data: {last.model_dump_json()}\n\n"
    except (RuntimeError, ValueError) as exc:
        yield error_for(exc).sse()
    except OpenAIError as exc:
        yield exc.sse()
    finally:
        call.close()
    yield "data: [DONE]\n\n"
