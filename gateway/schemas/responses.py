"""Bodies the handlers build as plain dicts or bytes (for speed), as models for the OpenAPI document only.

``gateway/inference/openai_format.py`` builds the completion bodies and ``gateway/errors.py`` the errors;
these models describe them (tests/gateway/test_openapi.py checks real bodies against them) and never run on a
request's path.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Doc(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    """Every error, of every route, in OpenAI's format."""

    error: ErrorDetail


class PromptTokensDetails(_Doc):
    cached_tokens: int


class CompletionTokensDetails(_Doc):
    reasoning_tokens: int


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprob]
    refusal: None


class TextLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


FinishReason = Literal["stop", "length", "tool_calls", "function_call"] | None  # the last: deprecated


class FunctionCall(_Doc):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Doc):
    """``content`` is null when the reply holds only tool calls; ``function_call`` is the call of a
    request that sent OpenAI's deprecated ``functions``."""

    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[MessageToolCall] | None = None
    function_call: FunctionCall | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class _CompletionHead(_Doc):
    id: str
    created: int
    model: str
    system_fingerprint: str | None


class ChatCompletion(_CompletionHead):
    """A whole chat completion (``stream`` false)."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Doc):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Doc):
    """A streamed call: its first delta has ``id``, ``type`` and ``function.name``; the next ones add
    fragments of ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: FunctionCallDelta | None = None  # deprecated ``functions``: name, then arguments


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(_CompletionHead):
    """One server-sent event of a streamed chat completion; ``usage`` only with
    ``stream_options.include_usage`` (null but in the last chunk, whose ``choices`` are empty)."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextChoice(_Doc):
    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason


class TextCompletion(_CompletionHead):
    """A whole text completion (``stream`` false)."""

    object: Literal["text_completion"]
    choices: list[TextChoice]
    usage: Usage


class TextCompletionChunk(_CompletionHead):
    """One server-sent event of a streamed text completion (``usage`` as in ``ChatCompletionChunk``)."""

    object: Literal["text_completion"]
    choices: list[TextChoice]
    usage: Usage | None = None


class ResponseText(_Doc):
    type: Literal["output_text"]
    text: str
    annotations: list[None]
    logprobs: list[TokenLogprob]


class ResponseMessage(_Doc):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[ResponseText]


class ResponseFunctionCall(_Doc):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(_Doc):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: CompletionTokensDetails
    total_tokens: int


class ResponseError(_Doc):
    code: str
    message: str | None


class ResponseObject(_Doc):
    """A whole ``response`` (the Responses API): ``output`` holds the assistant's message and its function
    calls; ``status`` ``incomplete`` (with ``incomplete_details.reason`` ``max_output_tokens``) when the
    reply was cut short. The request's settings are echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: dict[str, str] | None
    output: list[ResponseMessage | ResponseFunctionCall]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float
    top_p: float
    top_logprobs: int | None
    tool_choice: str | dict[str, str]
    tools: list[dict[str, object]]
    text: dict[str, object]
    truncation: Literal["disabled"]
    reasoning: dict[str, None]
    store: bool
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    service_tier: str
    background: Literal[False]


class ResponseEvent(_Doc):
    """One server-sent event of a streamed response (``event:`` names its ``type``): ``response.created``,
    ``response.in_progress``, per output item ``response.output_item.added`` ... ``response.output_item.done``
    (a message's ``response.content_part.added``, ``response.output_text.delta``/``.done``,
    ``response.content_part.done``; a call's ``response.function_call_arguments.delta``/``.done``), then
    ``response.completed`` or ``response.incomplete``; or ``error`` and ``response.failed`` if it broke."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    item: ResponseMessage | ResponseFunctionCall | None = None
    part: ResponseText | None = None
    delta: str | None = None
    text: str | None = None
    name: str | None = None
    arguments: str | None = None
    logprobs: list[TokenLogprob] | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    determinism_modes: list[str]  # extension: the modes this server can run


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Doc):
    status: Literal["ok"]


class ReadinessChecks(_Doc):
    model: bool
    database: bool


class Readiness(_Doc):
    status: Literal["ok", "unavailable"]
    checks: ReadinessChecks
