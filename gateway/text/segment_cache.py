"""Exact prompt token ids that reuse the ids of text segments a namespace sent before.

A chat client sends its whole conversation every turn, and admission tokenizes all of it: the cost grows
with the history, and a cold core (the usual state between requests) pays ~3x the hot price. A fast
tokenizer splits its input at its added tokens (``<|im_start|>``, ``<|im_end|>``, ...) before anything
else and then handles each piece on its own, so the ids of a rendered chat are the concatenation of each
piece's ids with the added tokens' ids between them. This module makes that split itself and keeps each
piece's ids in an LRU keyed by (namespace, BLAKE2b-128 of the piece): a conversation's earlier messages,
and a fixed system prompt, are tokenized once, and no prompt text outlives its request here.

Exactness: the split is the tokenizer's own first pass, leftmost-longest matches of the added tokens that
are matched before normalization, which this module reproduces only when none of them strips whitespace
or matches single words and the tokenizer neither truncates, pads nor encodes special tokens as text;
otherwise (or without a Rust backend) every call tokenizes the whole text as before. Each piece is then
encoded by the tokenizer itself, normalization and all.

Caller's text: a chat rendered from escaped content (``gateway.text.control_tokens``) is split the
same way, at the template's own control tokens; a piece holding an escape is unescaped and encoded with
special-token strings as text, and cached under a key of its own.

Isolation: entries are keyed by the caller's namespace (the tenant, or the key under a ``key`` cache
scope; no caching under ``request``), so no tenant can hit, or time, another's entries; a shared bound
means one tenant's volume can evict another's entries, which tells it nothing about their content.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gateway.text.control_tokens import ESC, ControlTokens

MAX_ENTRIES = 65_536
MAX_TOKENS = 1 << 21  # ids held in all (4 bytes each)


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer(text)["input_ids"]``, straight through a fast tokenizer's Rust backend when it has one:
    the same ids, without transformers' batch wrapping around a single text (a third of the cost)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def encode_rendered(tokenizer: Any, text: str, control: ControlTokens | None = None) -> list[int]:
    """The ids of a rendered chat without added special tokens, cached nowhere. With ``control``, the
    chat was rendered from escaped strings: the pieces holding escapes are encoded with special-token
    strings as text (each escape's string on its own where the tokenizer's split is not known)."""
    if control is None or ESC not in text:
        return encode(tokenizer, text, add_special_tokens=False)
    split = splitter(tokenizer)
    if split is None:
        return _split_ids(text, control.escapes, control.encode_escaped, lambda piece: encode(
            tokenizer, piece, add_special_tokens=False))
    pattern, added_ids = split

    def piece_ids(piece: str) -> list[int]:
        if ESC in piece:
            return control.encode_escaped(piece)  # type: ignore[union-attr]
        return encode(tokenizer, piece, add_special_tokens=False)

    return _split_ids(text, pattern, lambda token: [added_ids[token]], piece_ids)


def _split_ids(text: str, pattern: re.Pattern[str], match_ids: Callable[[str], list[int]],
               piece_ids: Callable[[str], Any]) -> list[int]:
    """The ids of ``text``: each match of ``pattern`` and each piece between matches, in order."""
    ids: list[int] = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            ids += piece_ids(text[start:match.start()])
        ids += match_ids(match.group())
        start = match.end()
    if start < len(text):
        ids += piece_ids(text[start:])
    return ids


@functools.lru_cache(maxsize=8)
def splitter(tokenizer: Any) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """The pattern of the tokenizer's first split and the ids of what it matches; ``None`` when this
    module cannot reproduce that split exactly."""
    return _splitter(getattr(tokenizer, "backend_tokenizer", None))


def _splitter(backend: Any) -> tuple[re.Pattern[str], dict[str, int]] | None:
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if getattr(backend, "encode_special_tokens", False):
        return None
    ids: dict[str, int] = {}
    for token_id, token in backend.get_added_tokens_decoder().items():
        if token.normalized:
            continue  # matched after normalization, inside each piece: the tokenizer's own business
        if token.lstrip or token.rstrip or token.single_word or not token.content:
            return None
        ids[token.content] = token_id
    if not ids:
        return None
    # Longest first: at each position the first alternative that matches is then the longest one.
    alternatives = sorted(ids, key=len, reverse=True)
    return re.compile("|".join(re.escape(a) for a in alternatives)), ids


class SegmentCache:
    """``encode(text, namespace)``: ``tokenizer(text, add_special_tokens=False)["input_ids"]``, with the
    pieces between added tokens looked up per namespace. Thread-safe (long prompts are tokenized in a
    worker thread)."""

    def __init__(
        self, tokenizer: Any, *, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS
    ) -> None:
        self._tokenizer = tokenizer
        split = splitter(tokenizer)
        self._pattern, self._added_ids = split if split is not None else (None, {})
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._entries: OrderedDict[tuple[str, bytes], array] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()
        self.num_hits = self.num_misses = 0

    @property
    def is_enabled(self) -> bool:
        """Whether pieces are cached (the tokenizer's split can be reproduced exactly)."""
        return self._pattern is not None

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, text: str, namespace: str | None, control: ControlTokens | None = None) -> list[int]:
        """The ids of ``text`` without added special tokens; ``namespace`` ``None`` caches nothing.
        ``control``: ``text`` was rendered from strings escaped by it (``encode_rendered``)."""
        if control is not None and ESC not in text:
            control = None  # nothing was escaped: the plain path
        if self._pattern is None or namespace is None:
            return encode_rendered(self._tokenizer, text, control)
        added_ids = self._added_ids
        return _split_ids(text, self._pattern, lambda token: [added_ids[token]],
                          lambda piece: self._piece(namespace, piece, control))

    def _piece(self, namespace: str, piece: str, control: ControlTokens | None) -> array | list[int]:
        is_text = control is not None and ESC in piece
        # A piece of the caller's escaped text hashes apart from the same string taken as it is.
        digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=16,
                                 person=b"text" if is_text else b"").digest()
        key = (namespace, digest)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return hit
            self.num_misses += 1
        if is_text:
            ids = control.encode_escaped(piece)  # type: ignore[union-attr]
        else:
            ids = encode(self._tokenizer, piece, add_special_tokens=False)
        if len(ids) > self.max_tokens:
            return ids
        stored = array("I", ids)
        with self._lock:
            if key not in self._entries:
                self._entries[key] = stored
                self._num_tokens += len(stored)
                while len(self._entries) > self.max_entries or self._num_tokens > self.max_tokens:
                    _, old = self._entries.popitem(last=False)
                    self._num_tokens -= len(old)
        return ids
