"""Salted, chained block hashes for the prefix cache.

The chain root is a keyed hash of the cache namespace under a per-process secret, so two namespaces
never produce the same chain (and no caller can pick a namespace that collides with another's root).
Every field is length-prefixed; Python's ``hash()`` is never used.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from array import array
from collections.abc import Callable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

# (parent, token ids) -> hash; injectable so tests can force collisions.
HashFn = Callable[[BlockHash, Sequence[int]], BlockHash]


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


class BlockHasher:
    """Computes chain roots and block hashes under one secret and model id."""

    def __init__(self, model_id: bytes = b"", secret: bytes | None = None,
                 hash_fn: HashFn | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(32)
        self._model_id = _lp(model_id)
        self._hash_fn = hash_fn  # replaces block_hash when set (tests force collisions with it)

    def root(self, namespace: bytes) -> BlockHash:
        """HMAC-SHA256 of the namespace: the parent of a sequence's first block."""
        return BlockHash(hmac.new(self._secret, _lp(namespace), hashlib.sha256).digest())

    def block_hash(self, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        """Keyed BLAKE2b over (parent hash, token ids, model id), each length-prefixed."""
        if self._hash_fn is not None:
            return self._hash_fn(parent, token_ids)
        h = hashlib.blake2b(key=self._secret, digest_size=32)
        h.update(_lp(parent))
        h.update(_lp(array("q", token_ids).tobytes()))
        h.update(self._model_id)
        return BlockHash(h.digest())
