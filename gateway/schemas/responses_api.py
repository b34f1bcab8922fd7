"""OpenAI's Responses API request (``POST /v1/responses``), strict as the completion requests are.

A request is read here and turned into a chat completion by ``gateway.inference.responses``, so it runs
through the same admission, quotas, audit, determinism and receipts. Fields OpenAI defines that would be a
lie to accept (hosted tools, background runs, reasoning effort, conversations kept by the server) are
400s naming the field; docs/compatibility.md lists every field's fate.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from gateway.schemas.openai import ChatCompletionRequest, Metadata, check_stream_options, one_error
from gateway.schemas.openai_tools import (
    MAX_TOOL_ARGUMENTS_CHARS,
    MAX_TOOLS,
    TOOL_NAME_PATTERN,
    FunctionDef,
    ToolCallFunction,
)
from policies import Determinism

MAX_INPUT_ITEMS = 4096  # as a chat request's messages
MAX_PARTS = 256  # content parts of one message
_Str = Annotated[str, Field(max_length=1_000_000)]
_Id = Annotated[str, Field(min_length=1, max_length=256)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ContentPart(_Strict):
    """A part of a message's content: text the user or the assistant wrote (``output_text`` as a previous
    response gave it, its annotations and logprobs carried back and ignored), or a refusal."""

    type: Literal["input_text", "output_text", "refusal"]
    text: _Str | None = None
    refusal: _Str | None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None  # kvgate writes none
    logprobs: Annotated[list[Any], Field(max_length=1_000_000)] | None = None

    @model_validator(mode="after")
    def _check_text(self) -> ContentPart:
        if (self.type == "refusal") != (self.refusal is not None) or (self.type == "refusal") == (
                self.text is not None):
            raise ValueError("a text part needs text, a refusal part needs refusal (and not text)")
        return self


class InputItem(_Strict):
    """One item of ``input``: a message (``type`` ``message`` or left out), a function call the model made
    (``function_call``, as a previous response gave it) or its result (``function_call_output``). One model
    rather than a union, so that an error's ``param`` is the field's path."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: _Str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    id: _Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    call_id: _Id | None = None
    name: Annotated[str, Field(max_length=64)] | None = None
    arguments: Annotated[str, Field(max_length=MAX_TOOL_ARGUMENTS_CHARS)] | None = None
    output: _Str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> InputItem:
        wanted = {"message": {"role", "content"}, "function_call": {"call_id", "name", "arguments"},
                  "function_call_output": {"call_id", "output"}}[self.type]
        allowed = wanted | {"type", "id", "status"}
        missing = sorted(f for f in wanted if getattr(self, f) is None)
        extra = sorted(f for f in self.model_fields_set - allowed if getattr(self, f) is not None)
        if missing or extra:
            what = f"needs {', '.join(missing)}" if missing else f"does not take {', '.join(extra)}"
            raise ValueError(f"a {self.type} item {what}")
        if self.type == "function_call":
            # The chat request's checks of a call's arguments (their depth).
            ToolCallFunction(name=self.name or "", arguments=self.arguments or "")
        return self

    def text(self) -> str:
        value = self.content if self.type == "message" else self.output
        if value is None or isinstance(value, str):
            return value or ""
        return "".join(p.text if p.text is not None else p.refusal or "" for p in value)


class FunctionTool(FunctionDef):
    """A function the model may call, in the Responses API's flat form (the chat request's ``FunctionDef``
    with its ``type``)."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _check_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            kind = str(data.get("type"))[:64]
            raise ValueError(f"tools of type {kind!r} are not served here; only function tools are (hosted "
                             "tools such as web_search or file_search would run nowhere)")
        return data

    def as_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema`` (flat, as the Responses
    API writes it; the chat request's ``json_schema`` nests the same fields)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)] | None = None
    description: Annotated[str, Field(max_length=65_536)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError("name and schema are required with type json_schema, and only allowed with it")
        return self

    def as_chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": self.model_dump(exclude={"type"}, exclude_none=True,
                                                                      by_alias=True)}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the one the served models have


class Reasoning(_Strict):
    """Accepted only empty: the served models do not reason in a separate channel."""

    effort: None = None
    summary: None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no padding is added: nothing for it to turn off


class ResponsesRequest(_Strict):
    """A Responses API request. Beyond OpenAI's fields, kvgate's ``determinism`` and ``seed`` (as chat
    completions take them). See docs/compatibility.md for what each field does here."""

    model: str = Field(min_length=1, max_length=256)
    # A string is read as the user's one message (``_input_text``).
    input: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: _Str | None = None
    previous_response_id: Annotated[str, Field(pattern=r"^resp_[0-9a-f]{32}$")] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: Annotated[list[Literal["message.output_text.logprobs"]], Field(max_length=8)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    # Lowers the server's and the policy's bound on the reply's calls, never raises it.
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # extension
    # vLLM's extensions, as chat completions take them (checked against the tenant's policy there).
    priority: int | None = Field(default=None, ge=-1000, le=1000)
    request_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    determinism: Determinism | None = None  # extension; validated against the tenant's policy

    @model_validator(mode="before")
    @classmethod
    def _input_text(cls, data: Any) -> Any:
        # ``input`` as a string is the user's one message: read as such, so that a list's errors are named by
        # their path (a union's would carry its member's tag).
        if isinstance(data, dict) and isinstance(data.get("input"), str):
            return data | {"input": [{"role": "user", "content": data["input"]}]}
        return data

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _check_tool_choice(cls, value: Any, handler: Any) -> Any:
        return one_error(value, handler, 'tool_choice must be "none", "auto", "required" or '
                                         '{"type": "function", "name": ...}')

    @model_validator(mode="after")
    def _check_stream_options(self) -> ResponsesRequest:
        check_stream_options(self.stream_options, self.stream)
        return self

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.include) or self.top_logprobs is not None


class ResponsesChat(ChatCompletionRequest):
    """A Responses request as the chat completion it runs as (``gateway.inference.responses.to_chat``),
    with what the reply and the audit need of the original."""

    # The Responses layer keeps its own record of the conversation (for ``previous_response_id``), so
    # the settlement keeps none of the chat completion.
    keeps_own_record: ClassVar[bool] = True
    _source: ResponsesRequest | None = PrivateAttr(default=None)
    _retain_days: int = PrivateAttr(default=0)
    _messages: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @property
    def max_tool_calls(self) -> int | None:
        """The Responses request's bound on the reply's calls (``gateway.inference.tools.max_tool_calls``
        takes the least of it, the policy's and the server's)."""
        return None if self._source is None else self._source.max_tool_calls

    @property
    def described_extra(self) -> dict[str, Any]:
        """What the ``request.admitted`` event records beyond a chat completion's fields."""
        src = self._source
        extra: dict[str, Any] = {"api": "responses"}
        if src is not None and src.previous_response_id is not None:
            extra["previous_response_id"] = src.previous_response_id
        return extra
