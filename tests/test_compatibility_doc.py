"""docs/compatibility.md names every request field a client may send: each field of OpenAI's chat,
completions and responses requests (as the installed ``openai`` SDK defines them, so a release that adds
one fails this test until the page gives it a fate) and each of vLLM's extensions to them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import response_create_params as responses_params

PAGE = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"

# vLLM's extensions to OpenAI's requests (vllm/entrypoints/openai/protocol.py: the chat, completion and
# responses requests' extra and sampling parameters).
VLLM_CHAT = {
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend",
    "guided_whitespace_pattern",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "include_reasoning", "structured_outputs",
}
VLLM_TEXT = {"prompt_embeds", "response_format"} | (VLLM_CHAT - {
    "add_generation_prompt", "continue_final_message", "documents", "chat_template", "chat_template_kwargs",
    "include_reasoning"})
VLLM_RESPONSES = {"request_id", "mm_processor_kwargs", "priority", "cache_salt"}


def _fields(params: type) -> set[str]:
    return {name for cls in params.__mro__ for name in getattr(cls, "__annotations__", {})}


def _named_in_tables(responses: bool) -> set[str]:
    """Every name in backticks on a table row of the page's Responses API section, or of the rest of it
    (``a.b`` also counts as ``a``)."""
    sections = re.split(r"^(?=## )", PAGE.read_text(encoding="utf-8"), flags=re.M)
    text = "".join(s for s in sections if s.startswith("## The Responses API") == responses)
    rows = [line for line in text.splitlines() if line.startswith("|")]
    names = {m for row in rows for m in re.findall(r"`([a-z_][a-z0-9_.]*)`", row)}
    return names | {n.split(".")[0] for n in names}


@pytest.mark.parametrize("api, fields", [
    ("chat", _fields(chat_params.CompletionCreateParamsBase) | VLLM_CHAT),
    ("completions", _fields(text_params.CompletionCreateParamsBase) | VLLM_TEXT),
    ("responses", _fields(responses_params.ResponseCreateParamsBase) | VLLM_RESPONSES),
])
def test_every_field_a_client_may_send_has_a_row(api: str, fields: set[str]) -> None:
    missing = sorted(fields - _named_in_tables(api == "responses"))
    assert not missing, f"docs/compatibility.md gives no fate to these {api} fields: {missing}"
