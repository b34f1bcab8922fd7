"""What every tool call parser shares: a call, the pieces a streamed reply is read into, a call's checks
against the request's tools, and the parser's contract."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs
import orjson

from gateway.inference.tools import ToolMode

_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def as_dict(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Piece:
    """One step of a streamed reply: content text, the start of call ``index`` (``call`` set), or a
    fragment of that call's arguments."""

    content: str | None = None
    index: int = 0
    call: Call | None = None
    arguments: str | None = None


def as_call(value: Any, mode: ToolMode) -> Call | None:
    """``value`` (a decoded ``{"name", "arguments"}``, or ``"parameters"`` as Llama writes it) as a call of
    a declared function whose arguments are an object (matching its ``parameters`` if it is ``strict``);
    ``None`` when it is none."""
    if not isinstance(value, dict) or value.get("name") not in mode.names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = orjson.loads(args)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    schema = mode.strict.get(value["name"])
    if schema is not None and not _matches(schema, args):
        return None
    try:
        return Call(value["name"], orjson.dumps(args).decode())
    except orjson.JSONEncodeError:  # a value JSON cannot hold (a pythonic call's set, say)
        return None


# A strict tool's schema is checked without retrieving anything it names (its metaschema check at
# admission refuses what it cannot resolve).
_OFFLINE = jsonschema_rs.Registry([])


def _matches(schema: dict[str, Any], args: dict[str, Any]) -> bool:
    try:
        return jsonschema_rs.validator_for(schema, registry=_OFFLINE).is_valid(args)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError):
        return False


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallParser:
    """Turns one choice's streamed text into ``Piece``s: ``feed`` each new text, ``finish`` once it has
    ended. Text that is not a call is content; a call's markup never is. One subclass per way of writing
    calls (``gateway.inference.tool_parsers``)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    def _content(self, text: str) -> list[Piece]:
        # Once a call was made, the blank lines around the next ones are no content.
        if not text or (self.num_calls and not text.strip()):
            return []
        return [Piece(content=text)]

    def _emit(self, call: Call) -> list[Piece]:
        # The model may write more calls than the prompt asked for: the first ones make the reply's
        # calls (the first alone with ``parallel_tool_calls: false``), the rest are dropped.
        limit = self.mode.max_calls if self.mode.parallel else 1
        if limit is not None and self.num_calls >= limit:
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [Piece(index=index, call=Call(call.name, "", call.id)),
                Piece(index=index, arguments=call.arguments)]

    def _emit_all(self, calls: list[Call]) -> list[Piece]:
        return [p for c in calls for p in self._emit(c)]
