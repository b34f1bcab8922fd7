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


FinishReason = Literal["stop", "length", "tool_calls"] | None


class FunctionCall(_Doc):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Doc):
    """``content`` is null when the reply holds only tool calls."""

    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[MessageToolCall] | None = None


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
