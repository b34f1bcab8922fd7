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

Isolation: entries are keyed by the caller's namespace (the tenant, or the key under a ``key`` cache
scope; no caching under ``request``), so no tenant can hit, or time, another's entries; a shared bound
means one tenant's volume can evict another's entries, which tells it nothing about their content.
"""

from __future__ import annotations

import hashlib
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

MAX_ENTRIES = 65_536
MAX_TOKENS = 1 << 21  # ids held in all (4 bytes each)


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer(text)["input_ids"]``, straight through a fast tokenizer's Rust backend when it has one:
    the same ids, without transformers' batch wrapping around a single text (a third of the cost)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _splitter(backend: Any) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """The pattern of the tokenizer's first split and the ids of what it matches; ``None`` when this
    module cannot reproduce that split exactly."""
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
        split = _splitter(getattr(tokenizer, "backend_tokenizer", None))
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

    def encode(self, text: str, namespace: str | None) -> list[int]:
        """The ids of ``text`` without added special tokens; ``namespace`` ``None`` caches nothing."""
        if self._pattern is None or namespace is None:
            return encode(self._tokenizer, text, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                ids += self._piece(namespace, text[start:match.start()])
            ids.append(self._added_ids[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._piece(namespace, text[start:])
        return ids

    def _piece(self, namespace: str, piece: str) -> array | list[int]:
        digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        key = (namespace, digest)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return hit
            self.num_misses += 1
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
