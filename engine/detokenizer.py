"""Incremental detokenization that never splits a UTF-8 character across deltas."""

from __future__ import annotations

_CONTEXT_TOKENS = 6  # prompt tokens decoded alongside, so leading spaces render as in the full text


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window ``ids[prefix_offset:]`` and emits what it adds beyond
    ``ids[prefix_offset:read_offset]``; text ending in U+FFFD (an incomplete byte sequence) is held
    back until the next token completes it.
    """

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text", "skip_special")

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.skip_special = skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int, final: bool = False) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        return self.flush(final)

    def flush(self, final: bool = True) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
