"""Bodies of vLLM's ``/tokenize`` and ``/detokenize``: a prompt or a chat to token ids, ids to text."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.schemas.chat_template import ChatTemplateFields
from gateway.schemas.openai import ChatMessage
from gateway.schemas.openai_tools import MAX_TOOLS, Tool

MAX_DETOKENIZE_IDS = 65_536


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class TokenizeRequest(ChatTemplateFields):
    """What to tokenize: ``prompt`` (as ``/v1/completions`` takes it) or ``messages`` and ``tools`` (as
    ``/v1/chat/completions`` renders them through the model's chat template, with its chat template
    fields), exactly one of the two."""

    model: str = Field(min_length=1, max_length=256)
    prompt: Annotated[str, Field(max_length=1_000_000)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _check_one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str = Field(min_length=1, max_length=256)
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=MAX_DETOKENIZE_IDS)]


class DetokenizeResponse(_Strict):
    prompt: str
