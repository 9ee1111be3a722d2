"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from tandem.entrypoints.openai.errors import OpenAIError, bad_request
from tandem.entrypoints.openai.fim import fim_prompt
from tandem.entrypoints.openai.prompt_logprobs import clamp, prompt_logprobs_json
from tandem.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from tandem.entrypoints.openai.serving import (
    EngineCall,
    ServerState,
    TokenText,
    error_for,
    prepare,
    prompt_size,
    sampled_and_top,
    sampling_params,
    started,
)
from tandem.entrypoints.openai.sse import SSEResponse
from tandem.entrypoints.openai.tenants import Tenant
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sampling_params import SamplingParams


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _append_logprobs(
    lp: CompletionLogprobs,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    offset: int,
    decode: TokenText,
) -> int:
    """Add tokens' completion-style logprobs to `lp` (an entry None, an echoed prompt's first token:
    no logprob, as vLLM gives it); returns the next text offset."""
    for token, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = decode(token)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            sampled, ranked = sampled_and_top(entry, token)
            text = decode(token, sampled)
            lp.token_logprobs.append(clamp(sampled.logprob))
            lp.top_logprobs.append({decode(t, p): clamp(p.logprob) for t, p in ranked})
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
    return offset


def _logprobs(c: CompletionOutput, offset: int, decode: TokenText) -> tuple[Any, int]:
    """Completion-style logprobs of a (delta) sample's tokens; returns them and the next text offset."""
    lp = CompletionLogprobs()
    offset = _append_logprobs(lp, c.token_ids, list(c.logprobs or []), offset, decode)
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
    # max_tokens 0 with echo (vLLM's way to score a prompt): one token is generated and not returned.
    prompt_only = body.max_tokens == 0
    if prompt_only and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    echo_logprobs = body.echo and body.logprobs is not None
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and echo_logprobs:
        prompt_logprobs = body.logprobs
    # best_of ranks samples by cumulative logprob: the engine computes it when logprobs are on.
    gen_logprobs = body.logprobs if body.logprobs is not None or best_of is None else 0
    max_tokens = 1 if prompt_only else body.max_tokens
    params = sampling_params(body, max_tokens, gen_logprobs, state, n=best_of, prompt_logprobs=prompt_logprobs)
    prompts = _prompts(body.prompt)
    tokenizer = started(state.engine.tokenizer)
    if body.suffix:
        prompts = [_fim(state, tokenizer, p, body.suffix) for p in prompts]
    request_id = random_id("cmpl")
    held: list[int | None] = [None] * len(prompts)
    prompt_params = None
    if prompt_only:
        prompts, prompt_params, held = await _hold_back_last_tokens(state, prompts, params)
    prepared = await prepare(state, request_id, prompts, params, body, tenant, prompt_params)
    decode = TokenText(tokenizer.decode_token, bool(body.return_tokens_as_token_ids or state.return_tokens_as_token_ids))
    n = params.n
    unsent = sum(h is not None for h in held)
    with EngineCall(state, tenant, prepared, unsent_prompt_tokens=unsent) as call:
        echo = None
        if body.echo:
            echo = [
                tokenizer.decode(req.prompt_token_ids + _listed(h), False) if text is None else text
                for (req, text), h in zip(prepared, held, strict=True)
            ]
        call.start()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return call.stream_to(
                lambda c: SSEResponse(
                    _stream(
                        state,
                        c,
                        request_id,
                        n,
                        echo,
                        body.logprobs is not None,
                        include_usage,
                        decode,
                        prompt_only,
                        held,
                    ),
                    c.close,
                )
            )
        if not await call.finish(receive):
            return None  # the client went away
    choices = []
    completion_tokens = 0
    for i, out in enumerate(call.outputs()):
        prompt_ids, prompt_entries = _whole_prompt(out, held[i])
        prompt_lps = prompt_logprobs_json(prompt_entries)
        samples = out.outputs if best_of is None else _best(out.outputs, body.n)
        for c in samples:
            token_ids, text = ([], "") if prompt_only else (c.token_ids, c.text)
            completion_tokens += len(token_ids)
            lp = None
            if body.logprobs is not None:
                lp, offset = CompletionLogprobs(), 0
                if echo_logprobs:
                    offset = _append_logprobs(lp, prompt_ids, list(prompt_entries or []), offset, decode)
                _append_logprobs(lp, token_ids, list(c.logprobs or []), offset, decode)
            choices.append(
                CompletionChoice(
                    index=i * body.n + c.index,
                    text=(echo[i] if echo else "") + text,
                    logprobs=lp,
                    finish_reason="length" if prompt_only and c.finish_reason is not None else c.finish_reason,
                    stop_reason=None if prompt_only else c.stop_reason,
                    prompt_logprobs=prompt_lps,
                )
            )
    usage = call.usage(completion_tokens)
    return CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage)


def _listed(token: int | None) -> list[int]:
    return [] if token is None else [token]


async def _hold_back_last_tokens(
    state: ServerState, prompts: list[Any], params: SamplingParams
) -> tuple[list[Any], list[SamplingParams], list[int | None]]:
    """Scoring prompts (echo with max_tokens 0): the prompts as token ids, each with its parameters
    and the last token held back from the engine, if any.

    The engine generates one token for a scored prompt (thrown away), and a prompt that fills
    max_model_len has no room for it. Such a prompt is sent without its last token, and the engine
    made to generate that token instead (greedy, the only one allowed, nothing else constraining
    it): its logprobs, of the raw distribution as every logprob, are the held token's prompt
    logprobs (`_whole_prompt` puts it back). Tokenized here (off the event loop when large) to know
    the length, with truncate_prompt_tokens applied as the processor applies it.
    """
    inputs = started(state.engine.inputs)
    max_model_len = started(state.engine.limits).max_model_len

    def hold() -> tuple[list[Any], list[SamplingParams], list[int | None]]:
        out: list[Any] = []
        own: list[SamplingParams] = []
        held: list[int | None] = []
        for prompt in prompts:
            try:
                text, ids = inputs.tokenize(prompt)
            except ValueError as exc:
                raise bad_request(exc, "prompt") from exc
            keep = params.truncate_prompt_tokens
            keep = max_model_len if keep == -1 else keep
            if keep is not None and len(ids) > keep:
                ids, text = ids[-keep:], None
            last = ids[-1] if len(ids) == max_model_len and len(ids) > 1 else None
            if last is None:
                out.append({"prompt_token_ids": ids, "prompt": text} if text is not None else ids)
                own.append(params)
            else:
                sent = {"prompt_token_ids": ids[:-1], "prompt": text} if text is not None else ids[:-1]
                out.append(sent)
                own.append(_generate_exactly(params, last))
            held.append(last)
        return out, own, held

    return await state.offload(sum(prompt_size(p) for p in prompts), hold)


def _generate_exactly(params: SamplingParams, token: int) -> SamplingParams:
    """`params` made to generate `token` and nothing else, with its logprobs at the prompt's k."""
    try:
        return params.clone(
            temperature=0.0,
            allowed_token_ids=[token],
            logit_bias=None,
            bad_words=None,
            bad_words_token_ids=None,
            structured_outputs=None,
            min_tokens=0,
            stop=[],
            stop_token_ids=[],
            logprobs=params.prompt_logprobs,
        )
    except ValueError as exc:
        raise bad_request(exc) from exc


def _whole_prompt(
    out: RequestOutput, held: int | None
) -> tuple[list[int], list[dict[int, Logprob] | None] | None]:
    """A scored prompt's ids and prompt logprobs, with its held-back last token put back (the first
    sample generated it: its logprobs are that token's)."""
    if held is None:
        return out.prompt_token_ids, out.prompt_logprobs
    ids = [*out.prompt_token_ids, held]
    if out.prompt_logprobs is None:
        return ids, None
    generated = out.outputs[0].logprobs if out.outputs else None
    return ids, [*out.prompt_logprobs, generated[0] if generated else None]


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
    prompt_only: bool = False,
    held: list[int | None] | None = None,
) -> AsyncIterator[str]:
    """With echo, each choice's first chunk is its prompt; with logprobs too, that chunk waits for
    the prompt's logprobs and carries them. `prompt_only` (max_tokens 0): the prompt, then the
    finish, nothing generated; `held`: each prompt's last token held back from the engine
    (`_hold_back_last_tokens`), whose logprobs come with the generated token."""
    created = int(time.time())
    done: set[int] = set()  # choices whose finish was sent
    offsets: dict[int, int] = {}
    completion_tokens = 0
    unechoed: set[int] = set()  # prompts whose echo waits for their logprobs

    def chunk(choice: CompletionChoice) -> str:
        c = CompletionChunk(id=request_id, created=created, model=state.model_name, choices=[choice])
        return f"data: {c.model_dump_json()}\n\n"

    try:
        if echo and want_logprobs:
            unechoed = set(range(len(echo)))
        elif echo:
            for i, text in enumerate(echo):
                for k in range(n):
                    offsets[i * n + k] = len(text)
                    yield chunk(CompletionChoice(index=i * n + k, text=text))
        async for batch in call.updates():
            for i, out in batch:
                if i in unechoed and echo is not None:
                    held_token = held[i] if held is not None else None
                    started = call.so_far[i].started
                    if held_token is not None and not started:
                        continue  # the held token's logprobs come with the generated token
                    prompt_ids, entries = _whole_prompt(call.so_far[i].whole(), held_token)
                    entries = entries or []
                    if len(entries) < len(prompt_ids) and not started:
                        continue  # the prompt is still being computed
                    unechoed.discard(i)
                    echoed = CompletionLogprobs()
                    offset = _append_logprobs(echoed, prompt_ids, list(entries), 0, decode)
                    for k in range(n):
                        offsets[i * n + k] = offset
                        yield chunk(CompletionChoice(index=i * n + k, text=echo[i], logprobs=echoed))
                for c in out.outputs:  # each holds what is new (EngineCall.updates)
                    key = i * n + c.index
                    if key in done:
                        continue
                    finished = c.finish_reason is not None
                    if prompt_only:
                        if finished:
                            done.add(key)
                            yield chunk(CompletionChoice(index=key, text="", finish_reason="length"))
                        continue
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if want_logprobs and c.token_ids:
                        lp, offsets[key] = _logprobs(c, offsets.get(key, 0), decode)
                    if c.text or lp is not None or finished:
                        yield chunk(
                            CompletionChoice(
                                index=key,
                                text=c.text,
                                logprobs=lp,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                    if finished:
                        done.add(key)
        if include_usage:
            usage = call.usage(completion_tokens)
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
