"""vLLM's chat template fields, shared by ``/v1/chat/completions`` and ``/tokenize``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# The fields below; a /tokenize of a ``prompt`` (no template) refuses them.
TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ChatTemplateFields(_Strict):
    """How the model's chat template renders the messages, as vLLM takes it:

    Attributes:
        add_generation_prompt: End the prompt with the template's opening of an assistant turn (``true``,
            the default), so that the model writes a new message.
        continue_final_message: Leave the last message open (no end of turn) for the model to continue:
            it must be an assistant's, and ``add_generation_prompt`` must be ``false`` with it.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _check_not_both(cls, value: bool, info: ValidationInfo) -> bool:
        # As vLLM: the two ask for opposite ends, and add_generation_prompt defaults to true.
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message continues the last message instead of opening a new "
                             "one: send add_generation_prompt false with it")
        return value

    def template_options(self) -> dict[str, Any]:
        """The keyword arguments of ``apply_chat_template`` these fields set."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}
