"""Tools in a chat request: what ``tool_choice`` asks for, how tools and earlier calls reach the chat
template, and the JSON schema that forces a call when the choice is ``required`` or a named function.

A chat template with a tools section (one that reads ``tools``) renders them itself. Any other gets the
fallback below: a system prompt listing the functions and asking for ``<tool_call>`` blocks, earlier
calls written back as such blocks, and tool results as user turns in ``<tool_response>`` blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from gateway.errors import InvalidRequest
from gateway.schemas.openai import ChatCompletionRequest, ChatMessage
from gateway.schemas.openai_tools import NamedToolChoice, Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# The ways model families write calls in ``auto`` (``gateway.inference.tool_parsers``).
ToolFamily = Literal["hermes", "llama3_json", "mistral", "pythonic"]

FALLBACK_PROMPT = (
    "You can call functions. These are the functions available, as JSON:\n{tools}\n\n"
    "To call a function, answer with a <tool_call></tool_call> block holding a JSON object with the "
    'function\'s "name" and its "arguments", for example:\n'
    '<tool_call>{{"name": "{example}", "arguments": {{}}}}</tool_call>\n'
    "{how_many} Results come back in <tool_response></tool_response> blocks. "
    "When no function is needed, answer in plain text."
)


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a request's reply carries tool calls.

    Attributes:
        kind: ``auto``: parsed out of the text, as ``family`` writes calls; ``named``: the text is the named
            function's arguments (forced); ``required``: the text is a JSON call, or a JSON list of calls
            when ``parallel`` (forced).
        names: The functions the request declares.
        name: The named function (``named`` only).
        parallel: More than one call may be made.
        max_calls: The most calls one reply may make (the server's ``max_tool_calls``, lowered by the
            tenant's policy and the request's own); ``None`` where none was set (a replay of a receipt
            recorded before the bound existed).
        strict: The ``parameters`` of each function declared ``strict`` by name: in ``auto``, where no
            grammar holds the arguments, a call of one whose arguments do not match them is no call.
        legacy: The request came with OpenAI's deprecated ``functions``: its reply carries the call as
            ``function_call`` (``gateway.inference.legacy_functions``).
        family: How the model writes calls in ``auto``: its chat template's format
            (``gateway.inference.tool_parsers.tool_family``), Hermes's ``<tool_call>`` blocks by default.
    """

    kind: Literal["auto", "named", "required"]
    names: frozenset[str]
    name: str | None = None
    parallel: bool = True
    max_calls: int | None = None
    strict: Mapping[str, dict[str, Any]] = field(default_factory=dict, hash=False, compare=False)
    legacy: bool = False
    family: ToolFamily = "hermes"

    @property
    def is_forced(self) -> bool:
        return self.kind != "auto"


def max_tool_calls(req: ChatCompletionRequest, *bounds: int | None) -> int | None:
    """The most calls one reply of ``req`` may make: the least of ``bounds`` (the server's, the policy's;
    ``None`` for no bound) and the request's own (a Responses request's ``max_tool_calls``)."""
    # Only a Responses request carries one (its chat request reads it from its source).
    given = [b for b in (*bounds, getattr(req, "max_tool_calls", None)) if b is not None]
    return min(given) if given else None


def tool_mode(req: ChatCompletionRequest, max_calls: int | None = None,
              family: ToolFamily = "hermes") -> ToolMode | None:
    """What ``tools`` and ``tool_choice`` ask for, a reply making at most ``max_calls`` calls, written as
    ``family`` writes them; ``None`` when no call can be made.

    Raises:
        InvalidRequest: Duplicate function names, a ``tool_choice`` without ``tools``, or one naming a
            function ``tools`` does not declare (400, ``param`` naming the field).
    """
    choice, tools = req.tool_choice, req.tools or []
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"Two tools are named '{name}'.", param=f"tools.{i}.function.name")
    if choice not in (None, "none", "auto") and not tools:
        raise InvalidRequest("tool_choice needs tools to choose from.", param="tool_choice")
    if req.parallel_tool_calls is not None and not tools:
        raise InvalidRequest("parallel_tool_calls needs tools.", param="parallel_tool_calls")
    if not tools or choice == "none":
        return None
    # One call at most is the non-parallel form: the forced reply is one call, not a list of one.
    parallel = req.parallel_tool_calls is not False and max_calls != 1
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names '{choice.function.name}', which is not among tools.",
                                 param="tool_choice.function.name")
        return ToolMode("named", frozenset(names), choice.function.name, parallel=False, max_calls=1)
    strict = {t.function.name: parameters(t) for t in tools if t.function.strict}
    return ToolMode("required" if choice == "required" else "auto", frozenset(names), parallel=parallel,
                    max_calls=max_calls if parallel else 1, strict=strict, family=family)


def parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def _retarget_refs(value: Any, prefix: str) -> Any:
    """``value`` with its local ``$defs``/``definitions`` references renamed under ``prefix``."""
    if isinstance(value, list):
        return [_retarget_refs(v, prefix) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if k == "$ref" and isinstance(v, str):
            for section in ("#/$defs/", "#/definitions/"):
                if v.startswith(section):
                    v = f"#/$defs/{prefix}{v[len(section):]}"
            out[k] = v
        else:
            out[k] = _retarget_refs(v, prefix)
    return out


def _call_schema(tool: Tool, defs: dict[str, Any]) -> dict[str, Any]:
    """One call of ``tool`` as a JSON object; its parameters' definitions move into ``defs``, renamed, so
    that its references still resolve once it sits inside the whole schema."""
    prefix = f"{tool.function.name}__"
    params = _retarget_refs(parameters(tool), prefix)
    for section in ("$defs", "definitions"):
        for name, schema in (params.pop(section, None) or {}).items():
            defs[f"{prefix}{name}"] = schema
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forcing_schema(req: ChatCompletionRequest, mode: ToolMode) -> dict[str, Any]:
    """The JSON schema a forced reply must match: the named function's arguments; or one call
    (``{"name", "arguments"}``), or a non-empty list of at most ``mode.max_calls`` of them when calls may
    be parallel (without that bound a small model appends calls until ``max_tokens``)."""
    tools = req.tools or []
    if mode.kind == "named":
        return next(parameters(t) for t in tools if t.function.name == mode.name)
    defs: dict[str, Any] = {}
    calls = [_call_schema(t, defs) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1} if mode.parallel else dict(one)
    if mode.parallel and mode.max_calls is not None:
        schema["maxItems"] = mode.max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def has_tools_section(tokenizer: Any) -> bool:
    """Whether the model's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []]


def fallback_prompt(req: ChatCompletionRequest) -> str:
    tools = _tool_dicts(req)
    listed = "\n".join(orjson.dumps(t["function"]).decode() for t in tools)
    how_many = ("Make one call at most." if req.parallel_tool_calls is False
                else "For several calls, write one block per call.")
    return FALLBACK_PROMPT.format(tools=listed, example=tools[0]["function"]["name"], how_many=how_many)


def _arguments(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _native_message(m: ChatMessage) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _fallback_message(m: ChatMessage, names_by_id: dict[str, str]) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    if m.role == "tool":
        result = {"name": names_by_id.get(m.tool_call_id or "", ""), "content": m.text()}
        return {"role": "user", "content": f"<tool_response>{orjson.dumps(result).decode()}</tool_response>"}
    text = m.text()
    for c in m.tool_calls or []:
        call = {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
        block = f"{CALL_OPEN}{orjson.dumps(call).decode()}{CALL_CLOSE}"
        text = f"{text}\n{block}" if text else block
    return {"role": role, "content": text}


def template_input(tokenizer: Any, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the extra keyword arguments to give the chat template. A request without tools
    or tool turns renders as it always has: role and text."""
    offered = req.tools if req.tool_choice != "none" else None
    has_turns = any(m.tool_calls or m.role == "tool" for m in req.messages)
    if not offered and not has_turns:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages], {}
    if has_tools_section(tokenizer):
        return [_native_message(m) for m in req.messages], ({"tools": _tool_dicts(req)} if offered else {})
    names_by_id = {c.id: c.function.name for m in req.messages for c in m.tool_calls or []}
    messages = [_fallback_message(m, names_by_id) for m in req.messages]
    if offered:
        prompt = fallback_prompt(req)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, {}
