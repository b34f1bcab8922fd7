"""Incremental detokenization that never splits a UTF-8 character across deltas."""

from __future__ import annotations

import functools

_CONTEXT_TOKENS = 6  # prompt tokens decoded alongside, so leading spaces render as in the full text


@functools.lru_cache(maxsize=8)
def _added_ids(tokenizer) -> tuple[frozenset[int], frozenset[int]]:
    """The tokenizer's added tokens, and those of them its decoding skips as special."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = {i for i, t in added.items() if getattr(t, "special", False)} | set(tokenizer.all_special_ids)
    return frozenset(added), frozenset(special)


def spaced_decode(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    """``ids`` as text with a space between each added token (special ones) and the text beside it, as
    vLLM's and Hugging Face's Python tokenizers write them with ``spaces_between_special_tokens``."""
    added, special = _added_ids(tokenizer)
    pieces: list[str] = []
    run: list[int] = []
    for i in ids:
        if skip_special_tokens and i in special:
            continue
        if i not in added:
            run.append(i)
            continue
        if run:
            pieces.append(tokenizer.decode(run))
            run = []
        pieces.append(tokenizer.decode([i]))
    if run:
        pieces.append(tokenizer.decode(run))
    return " ".join(pieces)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window ``ids[prefix_offset:]`` and emits what it adds beyond
    ``ids[prefix_offset:read_offset]``; text ending in U+FFFD (an incomplete byte sequence) is held
    back until the next token completes it.
    """

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text", "skip_special", "is_spaced")

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.skip_special = skip_special_tokens
        self.is_spaced = bool(spaces_between_special_tokens)  # None: as the tokenizer decodes (unspaced)

    def _decode(self, ids: list[int]) -> str:
        if self.is_spaced:
            return spaced_decode(self.tokenizer, ids, self.skip_special)
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
