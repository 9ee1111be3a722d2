"""POST /v1/chat/completions (the prompt comes from the tokenizer's chat template)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

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
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
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
from tandem.entrypoints.openai.tool_calls import ToolPlan, plan_tools, template_message
from tandem.outputs import CompletionOutput


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


async def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt token ids of a conversation (large ones are rendered and tokenized off the loop)."""
    engine = state.engine
    convo = conversation(messages)
    size = sum(len(m["content"]) for m in convo)
    try:
        started(engine.inputs).check_length(size, "the messages")
        return await state.offload(
            size,
            started(engine.tokenizer).apply_chat_template,
            convo,
            add_generation_prompt,
            state.chat_template,
            tools,
            continue_final_message,
            template_kwargs,
        )
    except ValueError as exc:
        param = "messages"
        if "chat_template_kwargs" in str(exc):
            param = "chat_template_kwargs"
        elif "continue_final_message" in str(exc):
            param = "continue_final_message"
        raise bad_request(exc, param) from exc


def _logprobs(c: CompletionOutput, start: int, end: int, k: int, decode: TokenText) -> ChatLogprobs:
    content = []
    logprobs = c.logprobs or []
    for pos in range(start, min(end, len(logprobs))):
        token = c.token_ids[pos]
        sampled, ranked = sampled_and_top(logprobs[pos], token)
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
    tools = plan_tools(body, state.tool_parser)
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
                logprobs=_logprobs(c, 0, len(c.token_ids), logprobs, decode) if logprobs is not None else None,
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
    sent_text = [0] * n
    sent_tokens = [0] * n
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
                for c in out.outputs:
                    k = c.index
                    if finished[k]:
                        continue
                    delta = c.text[sent_text[k] :]
                    lp = None
                    if logprobs is not None and len(c.token_ids) > sent_tokens[k]:
                        lp = _logprobs(c, sent_tokens[k], len(c.token_ids), logprobs, decode)
                    done = c.finish_reason is not None
                    message, finish_reason = DeltaMessage(content=delta), c.finish_reason
                    if readers is not None:
                        delta, calls = readers[k].feed(c.text) if delta else ("", [])
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
                    sent_text[k] = max(sent_text[k], len(c.text))
                    sent_tokens[k] = len(c.token_ids)
                    if done:
                        finished[k] = True
                        completion_tokens += len(c.token_ids)
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
