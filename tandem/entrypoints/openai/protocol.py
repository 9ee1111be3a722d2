"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests are strict (no type coercion) and reject unknown fields, except the documented vLLM
extras, which every generation request accepts: top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, priority, include_stop_str_in_output,
allowed_token_ids, bad_words, cache_salt, truncate_prompt_tokens, return_tokens_as_token_ids, prompt_logprobs,
and the structured-output fields (response_format, structured_outputs, guided_json/regex/choice/grammar).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer, model_validator

from tandem.core.limits import MAX_CACHE_SALT_CHARS
from tandem.sampling_params import (
    INT32_MAX,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_CONTROLS,
)


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at position {exc.start}") from None
    return text


# Every integer a request carries has a range (they cross a process boundary as 64-bit values),
# and every text is valid Unicode (UTF-8 cannot hold a lone surrogate, which JSON can spell).
Text = Annotated[str, AfterValidator(_valid_unicode)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(Strict):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=INT32_MAX)] = 1
    seed: Int64 | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    # Bounded here, so an oversized map is refused by its count while the body is validated,
    # before any Python looks at its entries.
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_TOKEN_CONTROLS)] | None = None
    user: Text | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    priority: Int64 = 0
    include_stop_str_in_output: bool = False
    # Structured output (tandem/entrypoints/openai/structured.py reads these).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    allowed_token_ids: Annotated[list[Count], Field(max_length=MAX_TOKEN_CONTROLS)] | None = None
    bad_words: Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    cache_salt: Annotated[Text, Field(max_length=MAX_CACHE_SALT_CHARS)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: Count | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Count | None = None
    suffix: Text | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    # Messages may carry fields this server does not use (name, tool_call_id, ...); a chat template
    # may still render them, so their texts are checked too.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    @model_validator(mode="after")
    def _extra_texts_are_unicode(self) -> ChatMessage:
        stack = list((self.model_extra or {}).values())
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                _valid_unicode(value)
            elif isinstance(value, dict):
                stack.extend(value.keys())
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        return self


class FunctionDefinition(Strict):
    name: Annotated[Text, Field(min_length=1, max_length=256)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # vLLM extras for chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # rendered by the chat template with `messages`
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[int]


# -- responses -----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs` (keyed by token id in each position's dict)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# None for the first prompt token, then per token {token id: PromptLogprob}.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class OmitNone(BaseModel):
    """Serialized without its unset (None) fields: a streamed tool-call delta names its id, type
    and name only in the call's first delta, as OpenAI sends them (clients concatenate strings and
    replace `type`, so a null there would clobber what the first delta gave)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> Any:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
