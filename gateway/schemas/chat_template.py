"""vLLM's chat template fields, shared by ``/v1/chat/completions`` and ``/tokenize``."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

# The fields below; a /tokenize of a ``prompt`` (no template) refuses them.
TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# The template is Jinja run on the gateway: its variables are capped in number and size, and hold JSON
# scalars or flat lists of them, so that what a template can do with them is what it can already do with
# a message's text (a list is iterated at most this many times; the sandbox caps ``range``).
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024  # as compact JSON
MAX_TEMPLATE_LIST = 64
# What the template already gets, under these names: apply_chat_template's own parameters, what it
# renders with (the messages, tools, documents, the special tokens), and the globals of transformers'
# sandbox (its hardened ``dict`` and ``namespace`` among them) and Jinja's. A variable by one of these
# names would replace it; a tokenizer's other named special tokens are checked where it is known.
RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens", "extra_special_tokens",
    "raise_exception", "strftime_now", "dict", "namespace", "range", "lipsum", "cycler", "joiner",
    "loop", "self", "caller", "varargs",
})

_Name = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
_Scalar = bool | Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | float | Annotated[
    str, Field(max_length=MAX_TEMPLATE_KWARGS_BYTES)] | None
_Value = _Scalar | Annotated[list[_Scalar], Field(max_length=MAX_TEMPLATE_LIST)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ChatTemplateFields(_Strict):
    """How the model's chat template renders the messages, as vLLM takes it:

    Attributes:
        add_generation_prompt: End the prompt with the template's opening of an assistant turn (``true``,
            the default), so that the model writes a new message.
        continue_final_message: Leave the last message open (no end of turn) for the model to continue:
            it must be an assistant's, and ``add_generation_prompt`` must be ``false`` with it.
        chat_template_kwargs: Variables for the template (``enable_thinking``, say): up to 32 names
            (letters, digits, ``_``), each a JSON scalar or a list of up to 64 of them, 16 KiB in all as
            compact JSON; a name the template already uses (``messages``, ``tools``, ``bos_token``...) is
            refused. Special-token strings in them are text.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[dict[_Name, _Value], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _check_not_both(cls, value: bool, info: ValidationInfo) -> bool:
        # As vLLM: the two ask for opposite ends, and add_generation_prompt defaults to true.
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message continues the last message instead of opening a new "
                             "one: send add_generation_prompt false with it")
        return value

    @field_validator("chat_template_kwargs", mode="wrap")
    @classmethod
    def _check_kwargs(cls, value: Any, handler: Any) -> dict[str, Any] | None:
        # One message naming the variable, not one per member of the value's union.
        try:
            kwargs = handler(value)
        except ValidationError as e:
            where = e.errors(include_url=False)[0]["loc"]
            name = f"'{where[0]}'" if where else "each variable"
            raise ValueError(f"{name} must be a name of letters, digits and _ (at most 64) holding a JSON "
                             f"scalar or a list of at most {MAX_TEMPLATE_LIST} of them; at most "
                             f"{MAX_TEMPLATE_KWARGS} variables") from None
        if kwargs is None:
            return None
        for name in kwargs:
            if name in RESERVED_TEMPLATE_NAMES:
                raise ValueError(f"'{name}' is the chat template's own input; chat_template_kwargs may not "
                                 "set it")
        size = len(orjson.dumps(kwargs))
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise ValueError(f"the variables are {size} bytes as compact JSON; at most "
                             f"{MAX_TEMPLATE_KWARGS_BYTES} are accepted")
        return kwargs

    def template_fields(self) -> dict[str, Any]:
        """These fields by name, as sent or defaulted."""
        return {name: getattr(self, name) for name in TEMPLATE_FIELDS}
