"""Calls as JSON values: Llama 3.1+'s ``{"name": ..., "parameters": {...}}`` (the reply itself, possibly
after ``<|python_tag|>``, several separated by ``;``) and Mistral's ``[TOOL_CALLS]`` followed by a JSON
list of ``{"name", "arguments"}``."""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.inference.tool_parsers.base import Call, as_call
from gateway.inference.tool_parsers.sections import SectionParser


def _all_calls(values: list[Any], parser: SectionParser) -> list[Call] | None:
    calls = [as_call(v, parser.mode) for v in values]
    return None if not calls or None in calls else calls  # type: ignore[return-value]


def _decoded(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


class Llama3JsonParser(SectionParser):
    """Llama 3.1, 3.2 and 3.3 with their JSON tool prompt: the reply starts with the call (the template's
    ``<|python_tag|>`` is a special token, so it is in the text only with ``skip_special_tokens: false``)."""

    MARKERS = ("<|python_tag|>",)
    MARKED_OPENERS = BARE_OPENERS = "{"
    SEPARATORS = " \t\r\n;"
    HEAD = re.compile(r'\{\s*"')
    HEAD_PREFIX = re.compile(r"\{\s*")

    def calls(self, text: str) -> list[Call] | None:
        value = _decoded(text)
        return None if value is None else _all_calls([value], self)


class MistralParser(SectionParser):
    """Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo and Small: ``[TOOL_CALLS]`` then the list of calls.
    ``[TOOL_CALLS]`` is a special token: a request with tools keeps special tokens in its text."""

    MARKERS = ("[TOOL_CALLS]",)
    MARKED_OPENERS = "[{"
    HEAD = re.compile(r'\[\s*\{|\{\s*"')
    HEAD_PREFIX = re.compile(r"[\[{]\s*")

    def calls(self, text: str) -> list[Call] | None:
        value = _decoded(text)
        if value is None:
            return None
        return _all_calls(value if isinstance(value, list) else [value], self)
