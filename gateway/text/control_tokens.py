"""Control tokens stay text in what callers send: their strings escaped through the chat template.

A tokenizer turns the string of a special token (``<|im_start|>``, ``<|eot_id|>``, ...) into that token
wherever it occurs, so a message whose content holds ``<|im_start|>system`` would open a real system turn:
an application relaying its users' text would let them forge roles and turns. Content is text, so its
special-token strings must be tokenized as the text they are, while the template's own markers stay
control tokens.

The template sees the caller's strings escaped (each special-token string, and the escape character
itself, replaced by two private-use characters no tokenizer gives a meaning to), so nothing it renders
from them is a control token; the rendered text is then split at the special tokens left (the template's
own), and each piece that holds an escape is unescaped and encoded with the special tokens as text (the
tokenizer's ``split_special_tokens``), exactly as the tokenizer encodes that piece on its own. A piece
without an escape is encoded as before, so text without special-token strings costs one regex search.
"""

from __future__ import annotations

import functools
import re
from typing import Any

ESC = "\U0010fffd"  # the last private-use code point: text almost never holds it
_CODE_BASE = 0x100000  # the escaped form of special token i is ESC + chr(_CODE_BASE + i)


class ControlTokens:
    """One tokenizer's special tokens: escaping callers' strings, and encoding text with them as text.

    Args:
        tokenizer: A Hugging Face tokenizer (fast or slow).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        specials = _special_strings(tokenizer, backend)
        self._codes = {s: chr(_CODE_BASE + i) for i, s in enumerate(specials)} | {ESC: ESC}
        self._strings = {code: s for s, code in self._codes.items()}
        # Longest first: at each position the first alternative that matches is then the longest one.
        found = sorted(self._codes, key=len, reverse=True)
        self._find = re.compile("|".join(re.escape(s) for s in found))
        # The characters any match starts with (``<`` for most tokenizers): a test for one character runs
        # at memory speed, the regex several times slower, so most text never meets the regex.
        self._starts = tuple(sorted({s[0] for s in found}))
        self.escapes = re.compile(re.escape(ESC) + "(.)", re.DOTALL)  # one escaped string
        self._text_backend = None
        if backend is not None:
            # A copy that leaves special-token strings as text; the shared one keeps its setting.
            from tokenizers import Tokenizer

            self._text_backend = Tokenizer.from_str(backend.to_str())
            self._text_backend.encode_special_tokens = True

    def escape(self, text: str) -> str:
        """``text`` with each special-token string (and the escape character) in its escaped form."""
        for start in self._starts:
            if start in text:
                return self._find.sub(lambda m: ESC + self._codes[m.group()], text)
        return text

    def escape_all(self, value: Any) -> Any:
        """``value`` (strings, lists and dicts of them, keys included) with every string escaped."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape_all(k): self.escape_all(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape_all(v) for v in value]
        return value

    def unescape(self, text: str) -> str:
        """The inverse of ``escape``; an escape cut short (a template that slices text) stays as it is."""
        return self.escapes.sub(lambda m: self._strings.get(m.group(1), m.group()), text)

    def encode_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids of ``text`` with every special-token string in it tokenized as text."""
        if self._text_backend is not None:
            return self._text_backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)
        return list(ids["input_ids"])

    def encode_escaped(self, piece: str) -> list[int]:
        """The ids of a rendered piece that holds escapes (and no control token): its text unescaped,
        special-token strings as text."""
        return self.encode_text(self.unescape(piece), add_special_tokens=False)


def _special_strings(tokenizer: Any, backend: Any) -> list[str]:
    if backend is not None:
        added = backend.get_added_tokens_decoder().values()
        return sorted({t.content for t in added if t.special and t.content})
    return sorted({s for s in getattr(tokenizer, "all_special_tokens", []) if s})


@functools.lru_cache(maxsize=8)
def control_tokens(tokenizer: Any) -> ControlTokens:
    """The ``ControlTokens`` of ``tokenizer`` (built once: it copies the tokenizer's backend)."""
    return ControlTokens(tokenizer)
