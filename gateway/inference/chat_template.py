"""The chat template fields a request sets, checked against its messages before the template runs."""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from gateway.schemas.openai import ChatCompletionRequest


def check_continued(req: ChatCompletionRequest) -> None:
    """``continue_final_message`` continues the model's own turn, so the last message is an assistant's.

    Raises:
        InvalidRequest: The last message is another role's (400, ``param`` its role).
    """
    last = len(req.messages) - 1
    role = req.messages[last].role
    if req.continue_final_message and role != "assistant":
        raise InvalidRequest(f"continue_final_message continues the last message, which must then be an "
                             f"assistant's; messages[{last}] is a {role} message.",
                             param=f"messages.{last}.role")


def template_kwargs(tokenizer: Any, req: ChatCompletionRequest) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` for ``tokenizer``'s template.

    Raises:
        InvalidRequest: One names a special token of the tokenizer, which the template gets under that
            name (400, ``param`` ``chat_template_kwargs``).
    """
    kwargs = req.chat_template_kwargs or {}
    named = getattr(tokenizer, "special_tokens_map", None) or {}
    for name in kwargs:
        if name in named:
            raise InvalidRequest(f"'{name}' is the chat template's own input (a special token of this "
                                 "model); chat_template_kwargs may not set it.", param="chat_template_kwargs")
    return dict(kwargs)


def template_features(req: ChatCompletionRequest) -> list[str]:
    """The chat template fields ``req`` sets away from their defaults, by name (never a value), for its
    ``request.admitted`` event: a replay of it needs its body, where they are."""
    return [name for name, value in req.template_fields().items()
            if value != ChatCompletionRequest.model_fields[name].default]
