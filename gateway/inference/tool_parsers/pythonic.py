"""Pythonic calls (Llama 3.2 and 4 with their pythonic tool prompt, some fine-tunes): the reply starts
with a Python list of calls, ``[get_weather(city="Paris"), get_time()]``, read with ``ast`` and literals
only: nothing in it is ever run."""

from __future__ import annotations

import ast
import re
from typing import Any

from gateway.inference.tool_parsers.base import Call, as_call
from gateway.inference.tool_parsers.sections import SectionParser


def _call_value(node: ast.expr) -> dict[str, Any] | None:
    """One ``name(key=literal, ...)`` as ``{"name", "arguments"}``; ``None`` for anything else (positional
    or ``**`` arguments, a dotted name, a value that is no literal)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return {"name": node.func.id, "arguments": args}


class PythonicParser(SectionParser):
    BARE_OPENERS = "["
    BRACKETS, QUOTES = "[](){}", "\"'"
    HEAD = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
    HEAD_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")

    def calls(self, text: str) -> list[Call] | None:
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, MemoryError, RecursionError):  # too deep a nesting, say
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        values = [_call_value(e) for e in tree.body.elts]
        calls = [as_call(v, self.mode) for v in values if v is not None]
        return calls if len(calls) == len(values) and None not in calls else None  # type: ignore[return-value]
