"""Tool calls out of generated text, whole or streamed, one parser per way a model family writes them."""

from __future__ import annotations

from gateway.inference.tool_parsers.base import Call, CallParser, Piece
from gateway.inference.tool_parsers.detect import template_family, tool_family
from gateway.inference.tool_parsers.forced import ForcedParser, forced_calls
from gateway.inference.tool_parsers.hermes import HermesParser
from gateway.inference.tool_parsers.json_calls import Llama3JsonParser, MistralParser
from gateway.inference.tool_parsers.pythonic import PythonicParser
from gateway.inference.tools import ToolFamily, ToolMode

__all__ = ["Call", "CallParser", "Piece", "keeps_special_tokens", "parse_reply", "parser_for",
           "template_family", "tool_family"]

PARSERS: dict[ToolFamily, type[CallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}


def parser_for(mode: ToolMode) -> CallParser:
    """A parser for one choice of a reply read as ``mode`` says: a forced reply is JSON (its grammar's),
    an ``auto`` one is read in its model's family's format."""
    return ForcedParser(mode) if mode.is_forced else PARSERS[mode.family](mode)


def keeps_special_tokens(mode: ToolMode) -> bool:
    """Whether the reply's text must keep special tokens for its calls to be read: Mistral's
    ``[TOOL_CALLS]`` is one (vLLM keeps them for it too)."""
    return mode.kind == "auto" and mode.family == "mistral"


def parse_reply(text: str, mode: ToolMode) -> tuple[str | None, list[Call]]:
    """A whole reply's content (``None`` when it holds only calls) and its calls."""
    if mode.is_forced:
        calls = forced_calls(text, mode)
        return (text, []) if calls is None else (None, calls)
    parser = parser_for(mode)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p.content for p in pieces if p.content is not None)
    calls = []
    for p in pieces:
        if p.call is not None:
            calls.append(p.call)
        elif p.arguments is not None:
            calls[-1] = Call(calls[-1].name, calls[-1].arguments + p.arguments, calls[-1].id)
    return (content.strip() or None) if calls else content, calls
