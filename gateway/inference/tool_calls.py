"""Tool calls out of generated text, whole or streamed: ``<tool_call>`` blocks (``tool_choice`` auto), the
named function's arguments, or the JSON call(s) a forced ``required`` reply holds.

A block that is not a call of a declared function (bad JSON, an unknown name) stays in the text. The
markup of a call never reaches the content, whole or streamed: a streamed tail that may be the start of
``<tool_call>`` is held back until the next text shows whether it is.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs
import orjson

from gateway.inference.tools import CALL_CLOSE, CALL_OPEN, ToolMode

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


def _as_call(value: Any, mode: ToolMode) -> Call | None:
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
    return Call(value["name"], orjson.dumps(args).decode())


# A strict tool's schema is checked without retrieving anything it names (its metaschema check at
# admission refuses what it cannot resolve).
_OFFLINE = jsonschema_rs.Registry([])


def _matches(schema: dict[str, Any], args: dict[str, Any]) -> bool:
    try:
        return jsonschema_rs.validator_for(schema, registry=_OFFLINE).is_valid(args)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError):
        return False


def _parse_block(text: str, mode: ToolMode) -> Call | None:
    try:
        return _as_call(orjson.loads(text.strip()), mode)
    except orjson.JSONDecodeError:
        return None


def _forced_calls(text: str, mode: ToolMode) -> list[Call] | None:
    """The calls of a forced reply; ``None`` when it is not one. A list of calls cut short (by
    ``max_tokens``, say) gives the calls it completed, the cut one dropped; ``None`` if it completed none."""
    if mode.kind == "named":
        try:
            args = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        return [Call(mode.name or "", orjson.dumps(args).decode())] if isinstance(args, dict) else None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = _complete_items(text)
        if not value:
            return None
    calls = [_as_call(v, mode) for v in (value if isinstance(value, list) else [value])]
    return None if not calls or None in calls else calls  # type: ignore[return-value]


_DECODER = json.JSONDecoder()


def _complete_items(text: str) -> list[Any]:
    """The items a JSON array cut short completed before the cut: ``[{..}, {..}, {..`` gives the first
    two. Nothing when ``text`` is no array's start."""
    text = text.lstrip()
    if not text.startswith("["):
        return []
    items, at = [], 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class CallParser:
    """Turns one choice's streamed text into ``Piece``s; ``finish`` once its text has ended."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0
        self._buf = ""  # outside a call: text not yet known to be content (at most a held-back tail)
        # Inside a call, and a forced reply whole: its text in pieces, joined once, so that a reply of n
        # characters costs O(n) however finely it streams (appending to one string copied it each time).
        self._parts: list[str] = []
        self._tail = ""  # a call's last len(CALL_CLOSE) - 1 characters, where its close may begin
        self._in_call = False
        self._named_id: str | None = None

    def feed(self, text: str) -> list[Piece]:
        if self.mode.kind == "named":
            return self._feed_named(text)
        if self.mode.kind == "required":
            self._parts.append(text)
            return []
        self._buf += text
        return self._scan()

    def finish(self) -> list[Piece]:
        if self.mode.kind == "named":
            return []
        buf, self._buf, parts, self._parts = self._buf, "", self._parts, []
        if self.mode.kind == "required":
            text = "".join(parts)
            calls = _forced_calls(text, self.mode)
            return [Piece(content=text)] if calls is None else [p for c in calls for p in self._emit(c)]
        if self._in_call:
            block = "".join(parts) + buf
            call = _parse_block(block, self.mode)
            return self._emit(call) if call is not None else [Piece(content=CALL_OPEN + block)]
        return self._content(buf)

    def _feed_named(self, text: str) -> list[Piece]:
        pieces = []
        if self._named_id is None:
            self._named_id = call_id()
            pieces.append(Piece(call=Call(self.mode.name or "", "", self._named_id)))
            self.num_calls = 1
        if text:
            pieces.append(Piece(index=0, arguments=text))
        return pieces

    def _scan(self) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if not self._in_call:
                at = self._buf.find(CALL_OPEN)
                if at < 0:
                    keep = _held_back(self._buf)
                    pieces += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return pieces
                pieces += self._content(self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(CALL_OPEN):], True
            block = self._close()
            if block is None:
                return pieces
            call = _parse_block(block, self.mode)
            pieces += self._emit(call) if call is not None else self._content(CALL_OPEN + block + CALL_CLOSE)

    def _close(self) -> str | None:
        """The call's whole block once the new text (``_buf``) closes it, the rest left in ``_buf``;
        ``None`` while it runs on. Only the new text and the tail before it are searched."""
        window = self._tail + self._buf
        at = window.find(CALL_CLOSE)
        if at < 0:
            self._parts.append(self._buf)
            self._buf, self._tail = "", window[max(0, len(window) - len(CALL_CLOSE) + 1):]
            return None
        text = "".join(self._parts) + self._buf
        end = len(text) - len(window) + at
        self._parts, self._tail, self._in_call = [], "", False
        self._buf = text[end + len(CALL_CLOSE):]
        return text[:end]

    def _content(self, text: str) -> list[Piece]:
        # Once a call was made, the blank lines around the next ones are no content.
        if not text or (self.num_calls and not text.strip()):
            return []
        return [Piece(content=text)]

    def _emit(self, call: Call) -> list[Piece]:
        # The model may write more blocks than the prompt asked for: the first ones make the reply's
        # calls (the first alone with ``parallel_tool_calls: false``), the rest are dropped.
        limit = self.mode.max_calls if self.mode.parallel else 1
        if limit is not None and self.num_calls >= limit:
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [Piece(index=index, call=Call(call.name, "", call.id)),
                Piece(index=index, arguments=call.arguments)]


def parse_reply(text: str, mode: ToolMode) -> tuple[str | None, list[Call]]:
    """A whole reply's content (``None`` when it holds only calls) and its calls."""
    if mode.is_forced:
        calls = _forced_calls(text, mode)
        return (text, []) if calls is None else (None, calls)
    parser = CallParser(mode)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p.content for p in pieces if p.content is not None)
    calls = []
    for p in pieces:
        if p.call is not None:
            calls.append(p.call)
        elif p.arguments is not None:
            calls[-1] = Call(calls[-1].name, calls[-1].arguments + p.arguments, calls[-1].id)
    return (content.strip() or None) if calls else content, calls
