"""Single token ids' text for logprobs, decoded once per tokenizer."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


class TokenText:
    """Decodes single token ids for logprobs, cached per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)
