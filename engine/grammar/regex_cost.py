"""The size a regex's counted repetitions expand it to, checked before the grammar library sees it.

The grammar library matches regexes by derivatives, and a counted repetition is unrolled: ``a{1000}{1000}``
is a million positions, and its first token mask costs seconds (measured on the default model's vocabulary:
2.4 to 10 s, and ``(ab){500}{500}`` 0.3 s on every token), while the library's fuel limits do not bound it.
Nested counts multiply, so a spec of a dozen bytes can ask for that; a flat count as large costs as much.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

MAX_REGEX_EXPANSION = 5_000  # positions; a{100}{100} (10,000) already costs ~60 ms a token mask
_COUNT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
_CAP = 10 ** 15  # sizes past this are all "too large"
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")


class _Parser:
    """A recursive-descent walk of Rust ``regex`` syntax that only sizes it: every atom (a literal, a
    class, an escape) is one position, a sequence and an alternation add up, a counted repetition
    multiplies by its largest count (``*``, ``+`` and ``?`` are loops: they do not unroll)."""

    def __init__(self, pattern: str) -> None:
        self.s, self.i = pattern, 0

    def _peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def alternation(self) -> int:
        total = self.sequence()
        while self._peek() == "|":
            self.i += 1
            total = min(_CAP, total + self.sequence())
        return total

    def sequence(self) -> int:
        total = 0
        while self._peek() not in ("", "|", ")"):
            total = min(_CAP, total + self._repeated(self._atom()))
        return total

    def _repeated(self, size: int) -> int:
        while True:
            c = self._peek()
            if c in ("*", "+", "?"):
                self.i += 1
            elif c == "{" and (m := _COUNT.match(self.s, self.i)):
                low, comma, high = m.groups()
                self.i = m.end()
                size = min(_CAP, size * max(1, _count(low), _count(high) if comma and high else 0))
            else:
                return size
            if self._peek() == "?":  # lazy
                self.i += 1

    def _atom(self) -> int:
        c = self._peek()
        self.i += 1
        if c == "(":
            return self._group()
        if c == "[":
            self._class()
            return 1
        if c == "\\":
            self._escape()
        return 1

    def _group(self) -> int:
        if self._peek() == "?":  # (?:..), (?P<name>..), (?<name>..), (?flags:..) or a bare (?flags)
            while self._peek() not in ("", ":", ")", ">"):
                self.i += 1
            if self._peek() == ")":
                self.i += 1
                return 0
            self.i += 1
        size = self.alternation()
        if self._peek() == ")":
            self.i += 1
        return size

    def _class(self) -> None:
        depth = 1
        if self._peek() == "^":
            self.i += 1
        if self._peek() == "]":  # a leading ] is a literal
            self.i += 1
        while depth and self.i < len(self.s):
            c = self._peek()
            self.i += 1
            if c == "\\":
                self._escape()
            elif c == "[" and self._peek() != ":":
                depth += 1
            elif c == "[":  # [:alpha:]
                self.i = self.s.find(":]", self.i) + 2 if ":]" in self.s[self.i:] else len(self.s)
            elif c == "]":
                depth -= 1

    def _escape(self) -> None:
        c = self._peek()
        self.i += 1
        if c in ("p", "P", "x", "u", "U") and self._peek() == "{":
            end = self.s.find("}", self.i)
            self.i = len(self.s) if end == -1 else end + 1


def _count(digits: str) -> int:
    return _CAP if len(digits) > 15 else int(digits)  # never int() of thousands of digits


def regex_expansion(pattern: str) -> int:
    """Positions ``pattern``'s counted repetitions expand it to (capped at 10^15)."""
    parser = _Parser(pattern)
    size = parser.alternation()
    while parser.i < len(pattern):  # an unbalanced ")": size the rest too (the library will refuse it)
        parser.i += 1
        size = min(_CAP, size + parser.alternation())
    return size


def schema_patterns(schema: object) -> Iterator[tuple[str, str]]:
    """``(where, regex)`` for every ``pattern`` and ``patternProperties`` key inside a JSON schema (walked
    with a stack: a schema may nest deeper than Python's recursion limit)."""
    stack: list[tuple[str, object]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
            if key == "pattern" and isinstance(value, str):
                yield where, value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from ((f"{where}[{json.dumps(k)}]", k) for k in value)
            if isinstance(value, (dict, list)):
                stack.append((where, value))


def grammar_regexes(grammar: str) -> Iterator[tuple[str, str]]:
    """``(where, regex)`` for every ``/regex/`` terminal of a Lark grammar."""
    for m in _LARK_REGEX.finditer(grammar):
        yield f"the terminal at character {m.start()}", m.group(1)


def too_costly(regexes: Iterator[tuple[str, str]]) -> str | None:
    """Why the first regex over ``MAX_REGEX_EXPANSION`` is refused, or None when none is."""
    for where, pattern in regexes:
        size = regex_expansion(pattern)
        if size > MAX_REGEX_EXPANSION:
            shown = f"{size:,}" if size < _CAP else "more than 10^15"
            return (f"{where}: its counted repetitions expand to {shown} positions; at most "
                    f"{MAX_REGEX_EXPANSION:,} are accepted (nested counts multiply: a{{1000}}{{1000}} is "
                    f"1,000,000)")
    return None
