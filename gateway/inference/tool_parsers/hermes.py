"""Hermes calls (Hermes 2 Pro, Qwen 2.5 and 3, and the fallback prompt for templates without tools):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text.

A block that is not a call of a declared function (bad JSON, an unknown name) stays in the text. A
streamed tail that may be the start of ``<tool_call>`` is held back until the next text shows whether
it is.
"""

from __future__ import annotations

import orjson

from gateway.inference.tool_parsers.base import Call, CallParser, Piece, as_call, held_back
from gateway.inference.tools import CALL_CLOSE, CALL_OPEN, ToolMode


def _parse_block(text: str, mode: ToolMode) -> Call | None:
    try:
        return as_call(orjson.loads(text.strip()), mode)
    except orjson.JSONDecodeError:
        return None


class HermesParser(CallParser):
    def __init__(self, mode: ToolMode) -> None:
        super().__init__(mode)
        self._buf = ""  # outside a call: text not yet known to be content (at most a held-back tail)
        # Inside a call: its text in pieces, joined once, so that a reply of n characters costs O(n)
        # however finely it streams (appending to one string copied it each time).
        self._parts: list[str] = []
        self._tail = ""  # a call's last len(CALL_CLOSE) - 1 characters, where its close may begin
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._scan()

    def finish(self) -> list[Piece]:
        buf, self._buf, parts, self._parts = self._buf, "", self._parts, []
        if self._in_call:
            block = "".join(parts) + buf
            call = _parse_block(block, self.mode)
            return self._emit(call) if call is not None else [Piece(content=CALL_OPEN + block)]
        return self._content(buf)

    def _scan(self) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if not self._in_call:
                at = self._buf.find(CALL_OPEN)
                if at < 0:
                    keep = held_back(self._buf, CALL_OPEN)
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
