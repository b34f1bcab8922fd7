"""A forced reply's calls: the named function's arguments, or the JSON call(s) a ``required`` reply holds
(a JSON grammar wrote them, whatever the model's own way of writing calls)."""

from __future__ import annotations

import json
from typing import Any

import orjson

from gateway.inference.tool_parsers.base import Call, CallParser, Piece, as_call, call_id
from gateway.inference.tools import ToolMode


def forced_calls(text: str, mode: ToolMode) -> list[Call] | None:
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
    calls = [as_call(v, mode) for v in (value if isinstance(value, list) else [value])]
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


class ForcedParser(CallParser):
    """A forced reply: the named function's arguments stream as they come; a ``required`` reply's text
    is kept (in pieces, joined once) and read whole when it ends."""

    def __init__(self, mode: ToolMode) -> None:
        super().__init__(mode)
        self._parts: list[str] = []
        self._named_id: str | None = None

    def feed(self, text: str) -> list[Piece]:
        if self.mode.kind == "required":
            self._parts.append(text)
            return []
        pieces = []
        if self._named_id is None:
            self._named_id = call_id()
            pieces.append(Piece(call=Call(self.mode.name or "", "", self._named_id)))
            self.num_calls = 1
        if text:
            pieces.append(Piece(index=0, arguments=text))
        return pieces

    def finish(self) -> list[Piece]:
        if self.mode.kind == "named":
            return []
        text, self._parts = "".join(self._parts), []
        calls = forced_calls(text, self.mode)
        return [Piece(content=text)] if calls is None else self._emit_all(calls)
