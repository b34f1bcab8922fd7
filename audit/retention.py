"""Optional prompt retention (off by default): AES-256-GCM per tenant, crypto-shredded on demand.

Each tenant gets a random 256-bit data key, stored only wrapped (AES-256-GCM) by a master key that
the caller supplies (``load_or_create_master_key`` reads a 0600 file in the data dir; the gateway
may pass bytes from its settings instead). Records are sealed with the tenant's data key and bound
to ``(tenant_id, record_id)`` as associated data, so a ciphertext cannot be moved between rows.
Deleting the tenant's wrapped key (``shred_tenant``) makes every record of that tenant unreadable at
once, even to a holder of the master key and of database backups taken afterwards.
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from audit.keys import load_or_create_secret
from audit.tables import retained_prompts, tenant_data_keys

MASTER_KEY_FILE = "retention_master.key"
MASTER_KEY_ENV = "KVGATE_RETENTION_MASTER_KEY"
_NONCE = 12


class RecordUnreadable(LookupError):
    """The record does not exist, or its tenant's data key was shredded."""


@dataclass(frozen=True, slots=True)
class RetainedRecord:
    id: str
    tenant_id: str
    request_id: str | None
    created_at: datetime
    expires_at: datetime
    prompt: Any
    completion: Any

    def __repr__(self) -> str:  # ids only, never content
        return f"RetainedRecord(id={self.id!r}, tenant_id={self.tenant_id!r})"


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """A retained record's metadata: what a listing may show without decrypting anything."""

    id: str
    tenant_id: str
    request_id: str | None
    created_at: datetime
    expires_at: datetime


def load_or_create_master_key(data_dir: Path) -> bytes:
    key = load_or_create_secret(data_dir / MASTER_KEY_FILE, lambda: secrets.token_bytes(32))
    if len(key) != 32:
        raise ValueError(f"{data_dir / MASTER_KEY_FILE} must hold exactly 32 bytes")
    return key


def parse_master_key(text: str) -> bytes:
    """A 32-byte master key given as 64 hex digits or as (URL-safe) base64.

    Raises:
        ValueError: Not 32 bytes in either encoding (the message never echoes the value).
    """
    text = text.strip()
    try:
        key = bytes.fromhex(text) if len(text) == 64 else base64.urlsafe_b64decode(
            text.replace("+", "-").replace("/", "_") + "=" * (-len(text) % 4))
    except (ValueError, binascii.Error):
        key = b""
    if len(key) != 32:
        raise ValueError(f"{MASTER_KEY_ENV} must be 32 bytes as 64 hex digits or base64")
    return key


def resolve_master_key(data_dir: Path, configured: str | None = None) -> bytes:
    """The configured key (settings or ``$KVGATE_RETENTION_MASTER_KEY``), else the data dir's key file."""
    value = configured or os.environ.get(MASTER_KEY_ENV)
    return parse_master_key(value) if value else load_or_create_master_key(data_dir)


def _seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    nonce = os.urandom(_NONCE)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def _open(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    return AESGCM(key).decrypt(sealed[:_NONCE], sealed[_NONCE:], aad)


class RetentionStore:
    """Encrypted prompt/completion records. The gateway decides who may read (explicit admin scope)."""

    def __init__(self, engine: AsyncEngine, master_key: bytes) -> None:
        if len(master_key) != 32:
            raise ValueError("master key must be 32 bytes (AES-256)")
        self.engine = engine
        self._master = master_key

    def __repr__(self) -> str:
        return "RetentionStore(<master key hidden>)"

    async def _data_key(self, tenant_id: str, *, create: bool) -> bytes | None:
        aad = b"kvgate/dek/" + tenant_id.encode()
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(tenant_data_keys.c.wrapped_key).where(
                tenant_data_keys.c.tenant_id == tenant_id))).first()
        if row is not None:
            return _open(self._master, row.wrapped_key, aad)
        if not create:
            return None
        dek = secrets.token_bytes(32)
        try:
            async with self.engine.begin() as conn:
                await conn.execute(insert(tenant_data_keys).values(
                    tenant_id=tenant_id, wrapped_key=_seal(self._master, dek, aad),
                    created_at=datetime.now(UTC)))
        except IntegrityError:
            return await self._data_key(tenant_id, create=False)  # a concurrent writer won; use theirs
        return dek

    async def put(self, tenant_id: str, prompt: Any, completion: Any, *, retain_days: int,
                  request_id: str | None = None, record_id: str | None = None) -> str:
        """Encrypt and store one record, as ``record_id`` (unique: a caller's own, such as a request id,
        for records it finds again by it) or a new id; returns its id."""
        if retain_days < 1:
            raise ValueError("retain_days must be >= 1")
        dek = await self._data_key(tenant_id, create=True)
        assert dek is not None
        record_id = record_id or secrets.token_hex(16)
        body = orjson.dumps({"prompt": prompt, "completion": completion})
        now = datetime.now(UTC)
        async with self.engine.begin() as conn:
            await conn.execute(insert(retained_prompts).values(
                id=record_id, tenant_id=tenant_id, request_id=request_id, created_at=now,
                expires_at=now + timedelta(days=retain_days),
                ciphertext=_seal(dek, body, f"{tenant_id}/{record_id}".encode())))
        return record_id

    async def get(self, tenant_id: str, record_id: str, now: datetime | None = None) -> RetainedRecord:
        """Decrypt one record of ``tenant_id``; an expired record is unreadable even before a purge.

        Raises:
            RecordUnreadable: Unknown, expired or another tenant's record, or a shredded data key.
        """
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(retained_prompts).where(
                retained_prompts.c.id == record_id, retained_prompts.c.tenant_id == tenant_id,
                retained_prompts.c.expires_at > (now or datetime.now(UTC))))).first()
        if row is None:
            raise RecordUnreadable(f"{record_id}: no such record, or it expired")
        dek = await self._data_key(tenant_id, create=False)
        if dek is None:
            raise RecordUnreadable(f"{record_id}: the tenant's data key was shredded")
        try:
            body = orjson.loads(_open(dek, row.ciphertext, f"{tenant_id}/{record_id}".encode()))
        except InvalidTag as e:
            raise RecordUnreadable(f"{record_id}: ciphertext failed authentication") from e
        return RetainedRecord(row.id, row.tenant_id, row.request_id, row.created_at, row.expires_at,
                              body["prompt"], body["completion"])

    async def list_records(self, tenant_id: str, *, limit: int = 100) -> list[RecordInfo]:
        """Metadata of the tenant's newest records, newest first."""
        q = select(retained_prompts.c.id, retained_prompts.c.tenant_id, retained_prompts.c.request_id,
                   retained_prompts.c.created_at, retained_prompts.c.expires_at).where(
            retained_prompts.c.tenant_id == tenant_id)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q.order_by(retained_prompts.c.created_at.desc()).limit(limit))).all()
        return [RecordInfo(*row) for row in rows]

    async def count_records(self, tenant_id: str) -> int:
        async with self.engine.connect() as conn:
            return (await conn.execute(select(func.count()).select_from(retained_prompts).where(
                retained_prompts.c.tenant_id == tenant_id))).scalar_one()

    async def shred_tenant(self, tenant_id: str, *, delete_records: bool = True) -> int:
        """Destroy the tenant's data key (crypto-shredding); returns the number of records affected."""
        async with self.engine.begin() as conn:
            await conn.execute(delete(tenant_data_keys).where(tenant_data_keys.c.tenant_id == tenant_id))
            count = (await conn.execute(select(func.count()).select_from(retained_prompts).where(
                retained_prompts.c.tenant_id == tenant_id))).scalar_one()
            if delete_records:
                await conn.execute(delete(retained_prompts).where(retained_prompts.c.tenant_id == tenant_id))
        return count

    async def purge_expired(self, now: datetime | None = None) -> int:
        async with self.engine.begin() as conn:
            result = await conn.execute(delete(retained_prompts).where(
                retained_prompts.c.expires_at <= (now or datetime.now(UTC))))
        return result.rowcount or 0
