"""Single token ids' text for logprobs, decoded once per tokenizer."""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any


class TokenText:
    """Decodes single token ids for logprobs, cached per tokenizer: ``text`` is a token's text, and a call
    the label a reply shows for it (its text, or ``token_id:N`` from ``labelled_by_id``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i]))
        self.is_labelled_by_id = False

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.is_labelled_by_id else self._decode(token_id)

    def text(self, token_id: int) -> str:
        return self._decode(token_id)

    def labelled_by_id(self) -> TokenText:
        """vLLM's ``return_tokens_as_token_ids``: tokens labelled ``token_id:N`` (a token that is part of
        a UTF-8 character has no text of its own to show), sharing this one's cache."""
        view = copy.copy(self)
        view.is_labelled_by_id = True
        return view
