"""OpenAI-compatible request models (strict: unknown fields, wrong types and NaN are 400s)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies import Determinism

_Str = Annotated[str, Field(max_length=1_000_000)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: _Str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _Str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


_Stop = Annotated[str, Field(min_length=1, max_length=256)]


class _SamplingFields(_Strict):
    """Fields both endpoints share. Beyond OpenAI's, three extensions as vLLM has them:

    Attributes:
        top_k: Sample from the k most likely tokens only; 0 or -1 disables.
        ignore_eos: Keep generating past the end-of-sequence token, up to ``max_tokens`` (benchmarks use
            it to generate an exact number of tokens).
        min_tokens: Generate at least this many tokens: until then neither the end-of-sequence token nor a
            ``stop`` string ends the completion. At most ``max_tokens`` (or, when that is unset, the room
            the context leaves after the prompt); more is a 400 with ``param`` ``min_tokens``.
        determinism: ``fast``, ``fixed`` or ``batch_invariant``, checked against the tenant's policy.
    """

    model: str = Field(min_length=1, max_length=256)
    n: int = Field(default=1, ge=1, le=8)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=1000)  # extension
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: _Stop | Annotated[list[_Stop], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)  # extension; at most max_tokens (admission)
    determinism: Determinism | None = None  # extension; validated against the tenant's policy

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=1_000_000)]


class CompletionRequest(_SamplingFields):
    prompt: _Str | _TokenIds | Annotated[list[_Str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
