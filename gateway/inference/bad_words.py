"""vLLM's ``bad_words``: each string as the token sequences the engine bans, tokenized as vLLM does."""

from __future__ import annotations

from typing import Any

from engine.request import MAX_BAD_WORD_TOKENS
from gateway.errors import InvalidRequest
from gateway.text.control_tokens import control_tokens
from gateway.text.segment_cache import encode


def bad_words_token_ids(tokenizer: Any, words: list[str] | None, vocab_size: int, *,
                        allow_special_tokens: bool = False) -> list[list[int]] | None:
    """The token sequences of ``words``: each word as it starts the text and, where that tokenizes to
    another first token but as many tokens, as it follows a space (vLLM's ``update_from_tokenizer``).
    Special-token strings in them are text unless ``allow_special_tokens``, as in prompts.

    Raises:
        InvalidRequest: A word of no tokens (whitespace), or of more than ``MAX_BAD_WORD_TOKENS``, or
            one the engine's vocabulary cannot hold (400, ``param`` ``bad_words``).
    """
    if not words:
        return None
    control = None if allow_special_tokens else control_tokens(tokenizer)

    def ids_of(text: str) -> list[int]:
        if control is None:
            return encode(tokenizer, text, add_special_tokens=False)
        return control.encode_text(text, add_special_tokens=False)

    sequences: list[list[int]] = []
    for word in words:
        first, spaced = ids_of(word.lstrip()), ids_of(" " + word.lstrip())
        if not first or len(first) > MAX_BAD_WORD_TOKENS or max(first + spaced) >= vocab_size:
            raise InvalidRequest(f"bad_words holds {word[:32]!r}, which is {len(first)} tokens; each must be "
                                 f"1 to {MAX_BAD_WORD_TOKENS} tokens of this model's vocabulary.",
                                 code="invalid_value", param="bad_words")
        sequences.append(first)
        if spaced[0] != first[0] and len(spaced) == len(first):
            sequences.append(spaced)
    return sequences
