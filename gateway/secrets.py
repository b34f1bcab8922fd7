"""Tenant API keys and admin tokens (generation, parsing, peppered hashing) and secret files on disk."""

from __future__ import annotations

import errno
import hmac
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import structlog

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

    def derive(self, label: bytes) -> bytes:
        """A 32-byte key for one purpose (``label``), from the pepper every replica shares."""
        return hmac.digest(self._pepper, b"kvgate derive:" + label, "sha256")


class UnsafeSecretPath(Exception):
    """A secret's file or directory that kvgate will not use as it is; the message says what to change."""


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner may enter: created 0700, or an existing one made 0700.

    Raises:
        UnsafeSecretPath: It is looser and cannot be tightened (owned by another user).
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(path, os.stat(path).st_mode, 0o700, lambda mode: os.chmod(path, mode))
    return path


def private_file(path: Path) -> None:
    """Create ``path`` empty and 0600 unless it exists; an existing one is made 0600 (never via a link).

    Raises:
        UnsafeSecretPath: A symbolic link, not a regular file, or looser and not ours to tighten.
    """
    os.close(_open_private(path, os.O_RDONLY | os.O_CREAT))


def read_secret(path: Path) -> bytes | None:
    """The bytes of the secret file at ``path`` (``None`` when there is none), made 0600 if looser.

    Raises:
        UnsafeSecretPath: A symbolic link, not a regular file, or looser and not ours to tighten.
    """
    try:
        fd = _open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_secret(path: Path, data: bytes, *, mode: int = 0o600, replace: bool = True) -> bool:
    """Put ``data`` at ``path`` atomically: written to a new file (``O_EXCL``, ``mode``) in the same
    directory and synced, then renamed over ``path`` or, without ``replace``, linked there only if
    ``path`` is free (``False`` when it was not: another process created it first).

    A crash leaves the old file or the whole new one, never part of one. A symbolic link planted at
    ``path`` is replaced (or, without ``replace``, left for ``read_secret`` to refuse), never followed.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)  # the new name itself survives a power loss
    finally:
        os.close(dir_fd)
    return True


def _open_private(path: Path, flags: int) -> int:
    try:  # O_NONBLOCK: opening a FIFO planted there must not hang; a regular file ignores it
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeSecretPath(f"{path} is a symbolic link; kvgate does not follow links at the paths "
                                   "of its secrets: put the file itself there") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeSecretPath(f"{path} is not a regular file")
        _tighten(path, st.st_mode, 0o600, lambda mode: os.fchmod(fd, mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _tighten(path: Path, mode: int, private: int, chmod: Callable[[int], None]) -> None:
    if not mode & 0o077:
        return
    was = f"{stat.S_IMODE(mode):o}"
    try:
        chmod(private)
    except OSError as e:
        raise UnsafeSecretPath(f"{path} is mode {was} and could not be made {private:o} ({e.strerror}): "
                               f"make it {private:o}, owned by the user kvgate runs as") from e
    structlog.get_logger().warning("secrets.mode_tightened", path=str(path), mode=f"{private:o}", was=was)


def load_or_create_pepper(data_dir: Path) -> bytes:
    """Read ``<data_dir>/pepper``, created on first use (32 random bytes, 0600, atomically).

    Raises:
        UnsafeSecretPath: The data dir or the pepper file is unsafe as it is (see ``read_secret``).
    """
    path = private_dir(data_dir) / "pepper"
    pepper = read_secret(path)
    if pepper is None:
        write_secret(path, secrets.token_bytes(32), replace=False)  # a concurrent creator's pepper wins
        pepper = read_secret(path)
    return pepper or b""
