"""Calls written as one bracketed value (a JSON object or list, a Python list of calls): after a marker
anywhere in the text, or bare where a value may start (the reply's start, or right after a call).

The text is read once: outside a value only a tail that may begin a marker is held back; inside one a
small scanner tracks its brackets and strings across pieces, and the value is decoded once it closes.
A value whose first characters cannot begin a call is content as soon as they show it.
"""

from __future__ import annotations

import re

from gateway.inference.tool_parsers.base import Call, CallParser, Piece, held_back
from gateway.inference.tools import ToolMode

HEAD_CHARS = 256  # a value not shown to be a call by its first characters is content
_BLANKS = " \t\r\n"


class Scanner:
    """Where a bracketed value that began with its opener ends: brackets counted outside strings,
    escapes inside them, carried over from one piece of text to the next."""

    def __init__(self, brackets: str, quotes: str) -> None:
        self._outside = re.compile("[" + re.escape(brackets + quotes) + "]")
        self._inside = {q: re.compile(r"[\\" + re.escape(q) + "]") for q in quotes}
        self._quotes, self._opens = quotes, brackets[0::2]
        self.parts: list[str] = []
        self._depth, self._quote, self._escape = 0, "", False

    def feed(self, text: str) -> int:
        """The index in ``text`` just past the value's close; -1 while it runs on (``text`` kept)."""
        i, n = 0, len(text)
        if self._escape and n:
            i, self._escape = 1, False
        while i < n:
            if self._quote:
                m = self._inside[self._quote].search(text, i)
                if m is None:
                    break
                i = m.end()
                if m.group() != "\\":
                    self._quote = ""
                elif i < n:
                    i += 1
                else:
                    self._escape = True
                continue
            m = self._outside.search(text, i)
            if m is None:
                break
            c, i = m.group(), m.end()
            if c in self._quotes:
                self._quote = c
            elif c in self._opens:
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self.parts.append(text[:i])
                    return i
        self.parts.append(text)
        return -1

    def text(self) -> str:
        return "".join(self.parts)


class SectionParser(CallParser):
    """A family that writes calls as bracketed values; subclasses say how (the class attributes) and
    decode a closed value into its calls (``calls``: ``None`` when it is not all calls of declared
    functions, so it stays content)."""

    MARKERS: tuple[str, ...] = ()  # open a value anywhere
    MARKED_OPENERS = ""  # what a value after a marker starts with
    BARE_OPENERS = ""  # what a value without a marker starts with, where one may start
    SEPARATORS = _BLANKS  # what may stand between one call's value and the next
    BRACKETS, QUOTES = "[]{}", '"'
    HEAD: re.Pattern[str]  # the start of a value that is a call
    HEAD_PREFIX: re.Pattern[str]  # what may still grow into HEAD

    def __init__(self, mode: ToolMode) -> None:
        super().__init__(mode)
        self._buf = ""
        # Expecting a value: the text restored as content if none comes (a marker; "" for a bare
        # start), and the blanks or separators seen since.
        self._expect: str | None = "" if self.BARE_OPENERS else None
        self._openers, self._seps = self.BARE_OPENERS, ""
        self._scanner: Scanner | None = None
        self._opened, self._head, self._is_call = "", "", False

    def calls(self, text: str) -> list[Call] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        pieces: list[Piece] = []
        while self._buf:
            if self._scanner is not None:
                pieces += self._in_value()
            elif self._expect is not None:
                pieces += self._expecting()
            else:
                pieces += self._free()
                if self._expect is None:  # no marker: the rest is held back
                    break
        return pieces

    def finish(self) -> list[Piece]:
        pieces = self.feed("")
        if self._scanner is not None:
            return pieces + self._content(self._opened + self._scanner.text())
        if self._expect is not None:
            return pieces + self._content(self._expect + self._seps)
        return pieces + self._content(self._buf)

    def _free(self) -> list[Piece]:
        found = [(at, m) for m in self.MARKERS if (at := self._buf.find(m)) >= 0]
        if not found:
            keep = max((held_back(self._buf, m) for m in self.MARKERS), default=0)
            pieces = self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return pieces
        at, marker = min(found)
        pieces = self._content(self._buf[:at])
        self._buf = self._buf[at + len(marker):]
        self._expect, self._openers = marker, self.MARKED_OPENERS
        return pieces

    def _expecting(self) -> list[Piece]:
        seps = self.SEPARATORS if self.num_calls else _BLANKS
        n = len(self._buf) - len(self._buf.lstrip(seps))
        self._seps += self._buf[:n]
        self._buf = self._buf[n:]
        if not self._buf:
            return []
        restored, self._expect, self._seps = (self._expect or "") + self._seps, None, ""
        if self._buf[0] in self._openers:
            self._scanner = Scanner(self.BRACKETS, self.QUOTES)
            self._opened, self._head, self._is_call = restored, "", False
            return []
        return self._content(restored)

    def _in_value(self) -> list[Piece]:
        assert self._scanner is not None
        if not self._is_call and self._is_refused():
            scanned, self._scanner = self._scanner.text(), None
            return self._content(self._opened + scanned)
        end = self._scanner.feed(self._buf)
        if end < 0:
            self._buf = ""
            return []
        text, self._scanner, self._buf = self._scanner.text(), None, self._buf[end:]
        calls = self.calls(text)
        if calls is None:
            return self._content(self._opened + text)
        # After a call, the next may follow without a marker.
        self._expect, self._openers = ("", self.BARE_OPENERS) if self.BARE_OPENERS else (None, "")
        return self._emit_all(calls)

    def _is_refused(self) -> bool:
        """Whether the value's first characters (with the new text) show it is no call; they are read
        only until they show either, so a long value costs nothing more here."""
        self._head += self._buf[: HEAD_CHARS - len(self._head)]
        self._is_call = self.HEAD.match(self._head) is not None
        return not self._is_call and (len(self._head) >= HEAD_CHARS
                                      or self.HEAD_PREFIX.fullmatch(self._head) is None)
