"""OpenAI's deprecated function calling read as tools: ``functions`` and ``function_call`` as ``tools`` and
``tool_choice`` (one call per reply), an assistant's ``function_call`` as its one tool call and a
``function`` message as the ``tool`` message answering it. The reply's call goes back in the old shape
(``gateway.inference.openai_format``), as OpenAI's did.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.errors import GatewayError, InvalidRequest
from gateway.schemas.openai import ChatCompletionRequest, ChatMessage
from gateway.schemas.openai_tools import NamedFunction, NamedToolChoice, Tool, ToolCall


def uses_functions(req: ChatCompletionRequest) -> bool:
    """Whether ``req`` offers its functions the deprecated way (its reply then answers in that shape)."""
    return req.functions is not None


def _has_legacy(req: ChatCompletionRequest) -> bool:
    return req.functions is not None or req.function_call is not None or any(
        m.role == "function" or m.function_call is not None for m in req.messages)


def check_relayable(req: ChatCompletionRequest | Any, is_upstream: bool) -> None:
    """An upstream pool is sent the client's fields as they are, and the servers behind it do not read
    the deprecated ones (vLLM ignores ``functions``): refused there, rather than run without them.

    Raises:
        InvalidRequest: A deprecated field or message for a model served upstream (400).
    """
    if not is_upstream or not isinstance(req, ChatCompletionRequest) or not _has_legacy(req):
        return
    param = next((p for p, v in (("functions", req.functions), ("function_call", req.function_call))
                  if v is not None), None)
    if param is None:
        param = next(f"messages.{i}" for i, m in enumerate(req.messages)
                     if m.role == "function" or m.function_call is not None)
    raise InvalidRequest("OpenAI's deprecated function calling is not relayed to this model's upstream "
                         "servers: send tools, tool_choice and tool messages instead.", param=param)


def _check(req: ChatCompletionRequest) -> None:
    """The deprecated fields make sense together, and not beside their successors.

    Raises:
        InvalidRequest: Both forms at once, a ``function_call`` without ``functions`` or naming none of
            them, or two functions of one name (400, ``param`` naming the field).
    """
    if req.functions is not None and req.tools is not None:
        raise InvalidRequest("functions is the deprecated form of tools: send one of the two.",
                             param="functions")
    if req.function_call is not None and req.tool_choice is not None:
        raise InvalidRequest("function_call is the deprecated form of tool_choice: send one of the two.",
                             param="function_call")
    if req.function_call is not None and req.functions is None:
        raise InvalidRequest("function_call needs functions to choose from.", param="function_call")
    for name in ("tool_choice", "parallel_tool_calls"):
        if req.functions is not None and getattr(req, name) is not None:
            raise InvalidRequest(f"{name} goes with tools; functions take function_call, and make one call "
                                 "at most.", param=name)
    names = [f.name for f in req.functions or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"Two functions are named '{name}'.", param=f"functions.{i}.name")
    choice = req.function_call
    if isinstance(choice, NamedFunction) and choice.name not in names:
        raise InvalidRequest(f"function_call names '{choice.name}', which is not among functions.",
                             param="function_call.name")


def _call_id(index: int) -> str:
    # Fixed by the message's place, so that a replay renders the same prompt; nine letters and digits,
    # as the strictest templates (Mistral's) want a call id.
    return f"fn{index:07d}"


def _messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages with each deprecated call as a tool call, and each result as the tool message that
    answers the latest call of its function (or, without one, a call of its own)."""
    out, latest = [], {}
    for i, m in enumerate(messages):
        if m.function_call is not None:
            call = ToolCall(id=_call_id(i), type="function", function=m.function_call)
            latest[m.function_call.name] = call.id
            m = m.model_copy(update={"function_call": None, "tool_calls": [call]})
        elif m.role == "function":
            m = m.model_copy(update={"role": "tool", "tool_call_id": latest.get(m.name or "", _call_id(i))})
        out.append(m)
    return out


def as_tools(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """``req`` with its deprecated fields read as tools; ``req`` itself when it has none.

    Raises:
        InvalidRequest: The deprecated fields do not fit together (``_check``).
    """
    if not _has_legacy(req):
        return req
    _check(req)
    update: dict[str, Any] = {"messages": _messages(req.messages), "functions": None, "function_call": None}
    if req.functions is not None:
        choice = req.function_call
        update |= {"tools": [Tool(type="function", function=f) for f in req.functions],
                   "tool_choice": (NamedToolChoice(type="function", function=choice)
                                   if isinstance(choice, NamedFunction) else choice),
                   "parallel_tool_calls": False}
    return req.model_copy(update=update)


_TOOL_PARAM = re.compile(r"^tools\.(\d+)\.function(\..*)?$")


def legacy_param(param: str | None) -> str | None:
    """The deprecated field a tools field ``param`` was read from."""
    if param is None:
        return None
    if param == "tools":
        return "functions"
    if param.startswith("tool_choice"):
        return "function_call" + param.removeprefix("tool_choice").removeprefix(".function")
    found = _TOOL_PARAM.match(param)
    return f"functions.{found.group(1)}{found.group(2) or ''}" if found else param


@contextmanager
def named_as_sent(req: ChatCompletionRequest) -> Iterator[None]:
    """A refusal raised in the block names the field ``req`` sent: ``functions.0.parameters`` for the
    ``tools.0.function.parameters`` it was read as."""
    try:
        yield
    except GatewayError as e:
        if uses_functions(req):
            e.param = legacy_param(e.param)
        raise
