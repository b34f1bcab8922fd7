"""Which way a model writes tool calls, read once from its chat template's text: a template with a tools
section tells the model the format, and the reply is read the same way."""

from __future__ import annotations

import functools
from typing import Any

from gateway.inference.tools import ToolFamily, has_tools_section

# What each family's published template holds, tried in order: Mistral's marker; the Hermes block (Qwen
# 2.5 and 3 too); the pythonic list's instructions (Llama 3.2's and 4's pythonic templates, "[func_name1(
# params_name1=params_value1, ...)]"); Llama 3.1's JSON instructions ("parameters") or its python tag.
_SIGNS: tuple[tuple[ToolFamily, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("pythonic", ("[func_name1(", "<|python_start|>")),
    ("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name')),
)


@functools.lru_cache(maxsize=32)
def template_family(template: str) -> ToolFamily:
    """The family a chat template's text writes calls in; Hermes when it shows none."""
    for family, signs in _SIGNS:
        if any(sign in template for sign in signs):
            return family
    return "hermes"


def tool_family(tokenizer: Any) -> ToolFamily:
    """How ``tokenizer``'s model writes calls: its template's family where the template renders tools,
    else Hermes, which the fallback prompt asks for (``gateway.inference.tools``)."""
    if not has_tools_section(tokenizer):
        return "hermes"
    return template_family(tokenizer.chat_template)
