"""POST /v1/chat/completions (the prompt comes from the tokenizer's chat template)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from tandem.engine.chat import template_message
from tandem.engine.tokenizer import Tokenizer
from tandem.entrypoints.openai.errors import OpenAIError, bad_request
from tandem.entrypoints.openai.prompt_logprobs import prompt_logprobs_json
from tandem.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTool,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from tandem.entrypoints.openai.serving import (
    INLINE_PROMPT_SIZE,
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
from tandem.entrypoints.openai.tool_calls import ToolPlan, plan_tools
from tandem.outputs import CompletionOutput

logger = logging.getLogger("tandem.server")


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content flattened to a string."""
    out = []
    for msg in messages:
        d = msg.model_dump(exclude_none=True)
        content = msg.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d["content"] = content or ""
        out.append(template_message(d))
    return out


def template_size(value: Any, limit: int | None = None) -> int:
    """The characters a chat template may render from `value` (messages, tools, template variables):
    every string, dict keys included, plus one for each item of any kind, so that a million empty
    strings weigh as much as they cost to render. Counting stops once past `limit`."""
    size = 0
    stack = [value]
    while stack and (limit is None or size <= limit):
        item = stack.pop()
        size += 1
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, BaseModel):
            stack.extend(vars(item).values())
            if item.model_extra:
                stack.append(item.model_extra)
    return size


async def checked_template_size(state: ServerState, *parts: Any) -> int:
    """The size of what the chat template will render from `parts` (`template_size`), or 400 when
    it cannot fit in max_model_len whatever it tokenizes to: refused before anything is rendered.
    Counted on the event loop up to what is rendered there anyway, beyond that in the tokenizer
    threads (the walk is as long as the request)."""
    inputs = started(state.engine.inputs)
    size = template_size(parts, INLINE_PROMPT_SIZE)
    if size > INLINE_PROMPT_SIZE:
        size = await state.offload(size, template_size, parts)
    try:
        inputs.check_length(size, "the messages and tools")
    except ValueError as exc:
        raise bad_request(exc, "messages") from exc
    return size


async def plan_request_tools(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    """`plan_tools`, off the event loop for large tools (a required or named tool_choice copies
    their schemas into the output's)."""
    size = template_size(body.tools, INLINE_PROMPT_SIZE)
    return await state.offload(size, plan_tools, body, state.tool_parser)


def template_takes_tools(state: ServerState, tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders `tools` at all, found once by rendering a one-message
    conversation with and without a tool; the first time it does not, the server log says so
    (the model is then never shown the tools, and a client only sees tool_calls=[])."""
    if state.template_takes_tools is None:
        convo = [{"role": "user", "content": "?"}]
        probe = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}]
        try:
            takes = tokenizer.apply_chat_template(convo, True, state.chat_template, probe) != (
                tokenizer.apply_chat_template(convo, True, state.chat_template)
            )
        except ValueError:
            takes = True  # the template needs more than the probe gives it: no claim about it
        state.template_takes_tools = takes
        if not takes:
            logger.warning(
                "the chat template ignores `tools`: requests' tools are never shown to the model, "
                "so it will not call them; serve a template that renders them with --chat-template"
            )
    return state.template_takes_tools


async def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: list[ChatTool] | list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    size: int | None = None,
) -> list[int]:
    """The prompt token ids of a conversation: refused by its size (every text the template may
    render, `checked_template_size`, unless the caller has `size` from it already) before it is
    rendered, then rendered and tokenized off the event loop when large."""
    tokenizer = started(state.engine.tokenizer)
    if size is None:
        size = await checked_template_size(state, messages, tools, template_kwargs)

    def render() -> list[int]:
        convo = conversation(messages)
        plain = [t.model_dump(exclude_none=True) if isinstance(t, BaseModel) else t for t in tools or ()]
        if plain:
            template_takes_tools(state, tokenizer)
        return tokenizer.apply_chat_template(
            convo,
            add_generation_prompt,
            state.chat_template,
            plain or None,
            continue_final_message,
            template_kwargs,
        )

    try:
        return await state.offload(size, render)
    except ValueError as exc:
        param = "messages"
        if "chat_template_kwargs" in str(exc):
            param = "chat_template_kwargs"
        elif "continue_final_message" in str(exc):
            param = "continue_final_message"
        raise bad_request(exc, param) from exc


def _logprobs(c: CompletionOutput, k: int, decode: TokenText) -> ChatLogprobs:
    """Chat-style logprobs of a sample's tokens (of a delta output, the new ones)."""
    content = []
    for token, entry in zip(c.token_ids, c.logprobs or [], strict=False):
        sampled, ranked = sampled_and_top(entry, token)
        text = decode(token, sampled)
        top = [
            TopLogprob(token=(s := decode(t, p)), logprob=p.logprob, bytes=list(s.encode()))
            for t, p in ranked[:k]
        ]
        content.append(
            TokenLogprob(token=text, logprob=sampled.logprob, bytes=list(text.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, tenant: Tenant | None, receive: Any
) -> Any:
    state.check_model(body.model)
    size = await checked_template_size(state, body.messages, body.tools, body.chat_template_kwargs)
    tools = await plan_request_tools(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs, state)
    tools.apply(params)
    ids = await chat_prompt_ids(
        state,
        body.messages,
        body.add_generation_prompt,
        tools.tools,
        body.continue_final_message,
        body.chat_template_kwargs,
        size,
    )
    request_id = random_id("chatcmpl")
    prepared = await prepare(state, request_id, [{"prompt_token_ids": ids}], params, body, tenant)
    decode = TokenText(
        started(state.engine.tokenizer).decode_token,
        bool(body.return_tokens_as_token_ids or state.return_tokens_as_token_ids),
    )
    # As vLLM: the reply's role is --response-role after a generation prompt, else the last message's.
    role = state.response_role if body.add_generation_prompt else body.messages[-1].role
    with EngineCall(state, tenant, prepared) as call:
        call.start()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return call.stream_to(
                lambda c: SSEResponse(
                    _stream(state, c, request_id, params.n, logprobs, include_usage, decode, tools, role),
                    c.close,
                )
            )
        if not await call.finish(receive):
            return None  # the client went away
    out = call.outputs()[0]
    choices = []
    for c in out.outputs:
        message, finish_reason = ChatResponseMessage(role=role, content=c.text), c.finish_reason
        if tools.reads_calls:
            content, calls = tools.message(c.text)
            message = ChatResponseMessage(role=role, content=content, tool_calls=calls)
            finish_reason = tools.finish_reason(c.finish_reason, bool(calls))
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=_logprobs(c, logprobs, decode) if logprobs is not None else None,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    usage = call.usage(sum(len(c.token_ids) for c in out.outputs))
    return ChatCompletionResponse(
        id=request_id,
        model=state.model_name,
        choices=choices,
        usage=usage,
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
    )


async def _stream(
    state: ServerState,
    call: EngineCall,
    request_id: str,
    n: int,
    logprobs: int | None,
    include_usage: bool,
    decode: TokenText,
    tools: ToolPlan,
    role: str = "assistant",
) -> AsyncIterator[str]:
    created = int(time.time())
    readers = [tools.reader() for _ in range(n)] if tools.reads_calls else None
    finished = [False] * n
    completion_tokens = 0

    def chunk(choice: ChatStreamChoice) -> str:
        c = ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=[choice])
        return f"data: {c.model_dump_json()}\n\n"

    try:
        for k in range(n):
            # With tool calls possible the content may stay null, as in the non-streamed message.
            first = DeltaMessage(role=role, content=None if readers is not None else "")
            yield chunk(ChatStreamChoice(index=k, delta=first))
        async for batch in call.updates():
            for _, out in batch:
                for c in out.outputs:  # each holds what is new (EngineCall.updates)
                    k = c.index
                    if finished[k]:
                        continue
                    delta = c.text
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if logprobs is not None and c.token_ids:
                        lp = _logprobs(c, logprobs, decode)
                    done = c.finish_reason is not None
                    message, finish_reason = DeltaMessage(content=delta), c.finish_reason
                    if readers is not None:
                        delta, calls = readers[k].append(delta) if delta else ("", [])
                        if done:
                            more, more_calls = readers[k].finish()
                            delta, calls = delta + more, calls + more_calls
                            finish_reason = tools.finish_reason(finish_reason, readers[k].called)
                        # No content: null, not "" (a client's accumulated content stays null).
                        message = DeltaMessage(content=delta or None, tool_calls=calls or None)
                    if message.content or message.tool_calls or lp is not None or done:
                        yield chunk(
                            ChatStreamChoice(
                                index=k,
                                delta=message,
                                logprobs=lp,
                                finish_reason=finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                    if done:
                        finished[k] = True
        if include_usage:
            usage = call.usage(completion_tokens)
            last = ChatCompletionChunk(
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
