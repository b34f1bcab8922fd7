"""Tenant API keys and admin tokens: generation, parsing and peppered HMAC-SHA256 hashing."""

from __future__ import annotations

import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

KeyId = NewType("KeyId", str)

TENANT_PREFIX = "kvg"
ADMIN_PREFIX = "kvga"
_ID_RE = re.compile(r"^[0-9a-f]{16}$")
_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{20,128}$")


@dataclass(frozen=True, slots=True)
class ParsedToken:
    prefix: str
    key_id: KeyId
    secret: str

    def __repr__(self) -> str:  # never the secret
        return f"ParsedToken(prefix={self.prefix!r}, key_id={self.key_id!r})"


def new_token(prefix: str) -> tuple[KeyId, str, str]:
    """Return ``(key_id, secret, full_token)`` for a fresh ``<prefix>_<key id>_<secret>`` token."""
    key_id = KeyId(secrets.token_hex(8))
    secret = secrets.token_urlsafe(32)
    return key_id, secret, f"{prefix}_{key_id}_{secret}"


def parse_token(token: str) -> ParsedToken | None:
    """Split a presented token; ``None`` when it is not well formed (never raises)."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] not in (TENANT_PREFIX, ADMIN_PREFIX):
        return None
    if not _ID_RE.match(parts[1]) or not _SECRET_RE.match(parts[2]):
        return None
    return ParsedToken(parts[0], KeyId(parts[1]), parts[2])


class Hasher:
    """HMAC-SHA256 keyed by a server pepper, so a leaked database alone cannot verify guesses."""

    def __init__(self, pepper: bytes) -> None:
        if len(pepper) < 32:
            raise ValueError("pepper must be at least 32 bytes")
        self._pepper = pepper

    def hash(self, key_id: str, secret: str) -> str:
        # The key id is bound into the MAC so a hash cannot be moved to another row. (``hmac.digest`` is
        # the one-shot C path: no HMAC object per request.)
        return hmac.digest(self._pepper, f"{key_id}:{secret}".encode(), "sha256").hex()

    def verify(self, key_id: str, secret: str, stored_hash: str) -> bool:
        return hmac.compare_digest(self.hash(key_id, secret), stored_hash)


def load_or_create_pepper(data_dir: Path) -> bytes:
    """Read ``<data_dir>/pepper`` (created 0600 with 32 random bytes on first use)."""
    path = data_dir / "pepper"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_bytes()
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path.read_bytes()
