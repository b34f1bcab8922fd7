"""OpenAI-compatible request models (strict: unknown fields, wrong types and NaN are 400s)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.schemas.chat_template import ChatTemplateFields
from gateway.schemas.openai_tools import (
    MAX_TOOLS,
    LegacyFunctionFields,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolChoice,
    schema_from,
)
from policies import Determinism

_Str = Annotated[str, Field(max_length=1_000_000)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: _Str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: deprecated
    content: _Str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    refusal: str | None = Field(default=None, max_length=65_536)  # as a reply's message carries it
    function_call: ToolCallFunction | None = None  # OpenAI's deprecated form of one tool call

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.function_call is not None and (self.role != "assistant" or self.tool_calls is not None):
            raise ValueError("function_call is only allowed on assistant messages, without tool_calls")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs the name of the function whose result it holds")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    """A stream's usage: ``include_usage`` (OpenAI's) adds a last chunk with it; ``continuous_usage_stats``
    (vLLM's) puts the usage so far in every chunk too. Unset, ``include_usage`` is false (OpenAI's
    default) unless ``continuous_usage_stats`` is true (vLLM's default is true); false with it is a 400."""

    include_usage: bool | None = None
    continuous_usage_stats: bool = False  # extension

    @model_validator(mode="after")
    def _check_continuous(self) -> StreamOptions:
        if self.continuous_usage_stats and self.include_usage is False:
            raise ValueError("continuous_usage_stats needs include_usage (the usage's last chunk)")
        return self


_Stop = Annotated[str, Field(min_length=1, max_length=256)]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 128  # each generated token is looked up among them
MAX_ALLOWED_TOKEN_IDS = 4096  # each step of the request scatters them into its row
MAX_BAD_WORDS = 128  # each is tokenized at admission and looked up by each step of the request
# Which completions API a request came by: /v1/chat/completions or /v1/completions.
RequestKind = Literal["chat", "text"]
_Choice = Annotated[str, Field(min_length=1, max_length=1024)]


def one_error(value: Any, handler: Any, message: str) -> Any:
    """``handler(value)`` (a wrap validator's), any failure as one error with ``message``: not one per
    member of a union, whose tags would end up in the error's ``param``."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(message) from None


def check_stream_options(stream_options: object, stream: bool) -> None:
    if stream_options is not None and not stream:
        raise ValueError("stream_options is only allowed when stream is true")


class SamplingFields(_Strict):
    """Fields both endpoints share. Beyond OpenAI's, extensions as vLLM has them:

    Attributes:
        top_k: Sample from the k most likely tokens only; 0 or -1 disables.
        min_p: In [0, 1]: sample only from tokens at least this fraction as likely as the most likely one;
            0 disables.
        ignore_eos: Keep generating past the end-of-sequence token, up to ``max_tokens`` (benchmarks use
            it to generate an exact number of tokens).
        min_tokens: Generate at least this many tokens: until then neither the end-of-sequence token nor a
            ``stop`` string ends the completion. At most ``max_tokens`` (or, when that is unset, the room
            the context leaves after the prompt); more is a 400 with ``param`` ``min_tokens``.
        stop_token_ids: Token ids that end the completion (the id is kept in the output, as vLLM does);
            at most 128, each in the vocabulary.
        skip_special_tokens: Leave special tokens out of the text (``true``, the default); ``false`` writes
            them as the tokenizer spells them.
        spaces_between_special_tokens: ``true``: a space between each special token and the text beside
            it (vLLM's slow-tokenizer spelling); ``false`` or unset (vLLM's with a fast tokenizer): none.
        truncate_prompt_tokens: Keep each prompt's last k tokens (after the chat template); -1 keeps the
            model's context; more than the context holds is a 400. The kept tokens are what the policy,
            the quotas and ``usage`` count; the byte cap on the prompt's text still applies before it is
            tokenized.
        prompt_logprobs: The top 0 to 20 log-probabilities of each prompt token after the first, with its
            own (vLLM's, in a whole reply: a text choice's ``prompt_logprobs``, a chat's beside its
            choices); every prompt position runs through the model's head, and the prompt is never
            taken from the prefix cache. Not with ``stream``.
        return_tokens_as_token_ids: Label logprob tokens ``token_id:N`` (a token that is part of a UTF-8
            character has no text of its own); ``bytes`` and ``text_offset`` stay the token's text's.
        include_stop_str_in_output: End the text after the ``stop`` string that ended it, instead of
            before it.
        bad_words: Strings the text must not hold (vLLM's): each word's last token is banned wherever the
            generated tokens before it are the word's others; at most 128 words of 1 to 128 characters
            and 32 tokens; not with ``allowed_token_ids`` or a structured output (they could leave no
            token).
        allowed_token_ids: Sample only among these tokens (1 to 4096 ids, each in the vocabulary); not
            with a structured output or a forced tool call, whose grammar picks the tokens.
        request_id: The caller's own id for the request (as vLLM takes it), recorded in its audit events;
            the response's ``id`` stays the gateway's, unique across tenants.
        priority: As vLLM's (lower runs first), among the tenant's own requests: a request may ask to run
            after them (above its policy's ``priority``), never ahead (below it counts as the policy's).
        determinism: ``fast``, ``fixed`` or ``batch_invariant``, checked against the tenant's policy.
        repetition_penalty: In (0, 2]; 1 disables. Divides the logit of every token already in the prompt
            or the output where positive, multiplies it where negative.
        guided_json, guided_regex, guided_choice, guided_grammar: What the generated text must match (a
            JSON schema, a regular expression, one of a list of strings, a Lark or GBNF grammar); at most
            one, and not with a JSON ``response_format``.
        structured_outputs: vLLM's current form of ``guided_*`` (``StructuredOutputs``): one of ``json``,
            ``regex``, ``choice``, ``grammar``, ``json_object`` and ``structural_tag``; the one constraint
            of the request.
    """

    model: str = Field(min_length=1, max_length=256)
    n: int = Field(default=1, ge=1, le=8)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=1000)  # extension
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: _Stop | Annotated[list[_Stop], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: _Penalty = 0.0
    presence_penalty: _Penalty = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)  # extension
    logit_bias: Annotated[dict[_TokenIdKey, _Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)  # extension; at most max_tokens (admission)
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]],  # extension
                              Field(max_length=MAX_STOP_TOKEN_IDS)] = Field(default_factory=list)
    skip_special_tokens: bool = True  # extension
    spaces_between_special_tokens: bool | None = None  # extension
    return_tokens_as_token_ids: bool = False  # extension
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # extension; -1 or >= 1
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # extension; not streamed
    include_stop_str_in_output: bool = False  # extension
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]],  # extension
                                 Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=128)]],  # extension
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    determinism: Determinism | None = None  # extension; validated against the tenant's policy
    guided_json: dict[str, Any] | str | None = None  # extension
    guided_regex: str | None = Field(default=None, min_length=1, max_length=16_384)  # extension
    guided_choice: Annotated[list[_Choice], Field(min_length=1, max_length=1024)] | None = None  # extension
    guided_grammar: str | None = Field(default=None, min_length=1, max_length=65_536)  # extension
    structured_outputs: StructuredOutputs | None = None  # extension: vLLM's form of guided_*
    priority: int | None = Field(default=None, ge=-1000, le=1000)  # extension, within the tenant's policy
    request_id: str | None = Field(default=None, min_length=1, max_length=128,  # extension
                                   pattern=r"^[A-Za-z0-9._:-]+$")
    # Extension, as vLLM's: accepted only from keys whose policy has ``trust_cache_salt`` (a front kvgate).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("guided_json")
    @classmethod
    def _check_guided_json(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return schema if schema is None else schema_from(schema)

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, k: int | None, info: ValidationInfo) -> int | None:
        if k is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return k

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncation(cls, keep: int | None) -> int | None:
        if keep == 0:  # vLLM's renders no prompt at all
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return keep

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        check_stream_options(self.stream_options, self.stream)
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        return options is not None and bool(options.include_usage or options.continuous_usage_stats)

    @property
    def is_usage_continuous(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def num_choices(self) -> int:
        """The choices of the reply (a text completion's prompts times ``n``)."""
        return self.n


_MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
_MetadataValue = Annotated[str, Field(max_length=512)]
# OpenAI's ``metadata``: up to 16 string pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[_MetadataKey, _MetadataValue], Field(max_length=16)]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, LegacyFunctionFields):
    """A chat completion. Beyond the shared fields, vLLM's chat template fields (``ChatTemplateFields``) and
    OpenAI's deprecated function calling (``LegacyFunctionFields``), OpenAI's that describe the request:

    Attributes:
        metadata: Up to 16 string pairs (keys up to 64 characters, values up to 512), recorded in the
            request's audit events.
        store: ``false``, or ``true`` where the tenant's policy retains prompts and completions
            (``prompt_retention_days``); ``true`` elsewhere is a 400, since nothing would be stored.
        service_tier: Accepted and recorded; every request is served in the one tier there is.
        safety_identifier: OpenAI's id of the end user for abuse checks (``user``'s successor); recorded.
        prompt_cache_key: OpenAI's hint for routing requests that share a prefix; accepted and ignored,
            since the prefix cache already finds a shared prefix within the tenant's namespace.
    """

    # Whether the endpoint keeps its own record of the request where the policy retains prompts (the
    # Responses API does, for ``previous_response_id``); else the settlement keeps the chat completion's.
    keeps_own_record: ClassVar[bool] = False
    described_extra: ClassVar[dict[str, Any]] = {}  # more for the request.admitted event (Responses API)

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)  # a routing hint: nothing to route

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _check_tool_choice(cls, value: Any, handler: Any) -> Any:
        return one_error(value, handler, 'tool_choice must be "none", "auto", "required" or '
                                         '{"type": "function", "function": {"name": ...}}')

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
MAX_CHOICES = 8  # a text completion's prompts times n: its rows in the engine, as n alone allows
_Prompts = Annotated[list[_Str], Field(min_length=1)] | Annotated[list[_TokenIds], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """A text completion. ``prompt`` is a string, token ids, or a list of either (vLLM's batch: choice
    ``prompt_index * n + i`` is the ``i``-th of prompt ``prompt_index``), at most 8 choices in all.
    ``echo`` writes each choice's prompt before its text (a string prompt as sent, token ids or a
    truncated prompt decoded), and with ``logprobs`` the prompt tokens' logprobs before the text's (the
    first token's ``null``)."""

    prompt: _Str | _TokenIds | _Prompts
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: None = None
    best_of: Literal[1] | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        # One message naming the field, not one per member of the union (whose tags end up in ``param``).
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of token ids (0 to 2**31 - 1), or a non-empty "
                             "list of either") from None
        num_prompts = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], str | list) else 1
        n = info.data.get("n", 1)
        if num_prompts * n > MAX_CHOICES:
            raise ValueError(f"{num_prompts} prompts of n={n} choices each make {num_prompts * n} choices; "
                             f"at most {MAX_CHOICES} are allowed")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: one, or those of a list."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
