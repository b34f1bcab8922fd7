"""Audit key material in the data dir: Ed25519 signing key and HMAC chain key (files, mode 0600)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNING_KEY_FILE = "audit_signing_key.pem"
CHAIN_KEY_FILE = "audit_chain.key"
PUBLIC_KEY_FILE = "audit_public_key.pem"


def _create_exclusive(path: Path, data: bytes) -> None:
    """Write ``data`` to a new 0600 file atomically; a concurrent creator wins and we keep theirs."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process created it first: both then read the winner's
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def load_or_create_secret(path: Path, make: callable) -> bytes:  # type: ignore[valid-type]
    """The secret file at ``path``; the first process to want it writes it from ``make()``."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _create_exclusive(path, make())
    return path.read_bytes()


def public_key_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(key: Ed25519PublicKey) -> str:
    """``SHA256:<hex>`` of the raw 32-byte public key."""
    return "SHA256:" + hashlib.sha256(public_key_bytes(key)).hexdigest()


def public_key_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key(data: bytes) -> Ed25519PublicKey:
    """Accept PEM (SubjectPublicKeyInfo) or the raw 32 bytes."""
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    key = serialization.load_pem_public_key(data)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("not an Ed25519 public key")
    return key


@dataclass(frozen=True, slots=True)
class AuditKeys:
    """Signing key (checkpoints, manifests) and chain key (HMAC chain, prompt hashes)."""

    signing_key: Ed25519PrivateKey
    chain_key: bytes

    def __repr__(self) -> str:
        return f"AuditKeys(fingerprint={self.fingerprint!r})"

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.signing_key.public_key()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def sign(self, message: bytes) -> str:
        return self.signing_key.sign(message).hex()

    def prompt_hash(self, text: str) -> str:
        """Keyed hash for ``prompt_hash`` fields; a sub-key so the chain key itself is never exposed."""
        return hmac.new(self.log_hash_key, text.encode(), hashlib.sha256).hexdigest()[:32]

    def token_ids_hash(self, token_ids: Sequence[int]) -> str:
        """The keyed hash ``request.admitted``/``finished`` record: over the exact token ids the engine ran
        (after the chat template), so equal prompts correlate and the text never shows."""
        return self.prompt_hash(",".join(map(str, token_ids)))

    def prompts_hash(self, prompts: Sequence[Sequence[int]]) -> str:
        """``token_ids_hash`` of several prompts in order (one prompt: its ``token_ids_hash``)."""
        return self.prompt_hash(";".join(",".join(map(str, ids)) for ids in prompts))

    def structured_hash(self, kind: str, spec: str) -> str:
        """The keyed hash of a structured output's kind and spec (never its cache key, which changes no
        token): a replay rebuilds the constraint from the request body and checks it against this."""
        return self.prompt_hash(f"{kind}\n{spec}")

    @property
    def log_hash_key(self) -> bytes:
        """Stable key for ``configure_logging(hash_key=...)`` (equals the prompt-hash sub-key)."""
        return hmac.new(self.chain_key, b"kvgate/prompt-hash/v1", hashlib.sha256).digest()

    @classmethod
    def generate(cls) -> AuditKeys:
        return cls(Ed25519PrivateKey.generate(), secrets.token_bytes(32))


def load_or_create_keys(data_dir: Path) -> AuditKeys:
    """Read (or create, 0600) the audit keys under ``data_dir``; also writes the public key PEM."""
    pem = load_or_create_secret(
        data_dir / SIGNING_KEY_FILE, lambda: Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    signing = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(signing, Ed25519PrivateKey):
        raise ValueError(f"{data_dir / SIGNING_KEY_FILE} is not an Ed25519 private key")
    chain_key = load_or_create_secret(data_dir / CHAIN_KEY_FILE, lambda: secrets.token_bytes(32))
    keys = AuditKeys(signing, chain_key)
    pub_path = data_dir / PUBLIC_KEY_FILE
    if not pub_path.exists():
        pub_path.write_bytes(public_key_pem(keys.public_key))
    return keys
