"""Optional prompt retention (off by default): AES-256-GCM per tenant, crypto-shredded on demand.

Each tenant gets a random 256-bit data key, stored only wrapped (AES-256-GCM) by a master key that
the caller supplies (``load_or_create_master_key`` reads a 0600 file in the data dir; the gateway
may pass bytes from its settings instead). Records are sealed with the tenant's data key and bound
to ``(tenant_id, record_id)`` as associated data, so a ciphertext cannot be moved between rows.
Deleting the tenant's wrapped key (``shred_tenant``) makes every record of that tenant unreadable at
once, even to a holder of the master key and of database backups taken afterwards.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from audit.keys import _load_or_create
from audit.tables import retained_prompts, tenant_data_keys

MASTER_KEY_FILE = "retention_master.key"
_NONCE = 12


class RecordUnreadable(LookupError):
    """The record does not exist, or its tenant's data key was shredded."""


@dataclass(frozen=True, slots=True)
class RetainedRecord:
    id: str
    tenant_id: str
    request_id: str | None
    created_at: datetime
    prompt: Any
    completion: Any

    def __repr__(self) -> str:  # lengths only, never content
        return f"RetainedRecord(id={self.id!r}, tenant_id={self.tenant_id!r})"


def load_or_create_master_key(data_dir: Path) -> bytes:
    key = _load_or_create(data_dir / MASTER_KEY_FILE, lambda: secrets.token_bytes(32))
    if len(key) != 32:
        raise ValueError(f"{data_dir / MASTER_KEY_FILE} must hold exactly 32 bytes")
    return key


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
                  request_id: str | None = None) -> str:
        """Encrypt and store one record; returns its id."""
        if retain_days < 1:
            raise ValueError("retain_days must be >= 1")
        dek = await self._data_key(tenant_id, create=True)
        assert dek is not None
        record_id = secrets.token_hex(16)
        body = orjson.dumps({"prompt": prompt, "completion": completion})
        now = datetime.now(UTC)
        async with self.engine.begin() as conn:
            await conn.execute(insert(retained_prompts).values(
                id=record_id, tenant_id=tenant_id, request_id=request_id, created_at=now,
                expires_at=now + timedelta(days=retain_days),
                ciphertext=_seal(dek, body, f"{tenant_id}/{record_id}".encode())))
        return record_id

    async def get(self, tenant_id: str, record_id: str) -> RetainedRecord:
        """Decrypt one record of ``tenant_id``.

        Raises:
            RecordUnreadable: Unknown record, another tenant's record, or a shredded data key.
        """
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(retained_prompts).where(
                retained_prompts.c.id == record_id, retained_prompts.c.tenant_id == tenant_id))).first()
        if row is None:
            raise RecordUnreadable(record_id)
        dek = await self._data_key(tenant_id, create=False)
        if dek is None:
            raise RecordUnreadable(f"{record_id}: the tenant's data key was shredded")
        try:
            body = orjson.loads(_open(dek, row.ciphertext, f"{tenant_id}/{record_id}".encode()))
        except InvalidTag as e:
            raise RecordUnreadable(f"{record_id}: ciphertext failed authentication") from e
        return RetainedRecord(row.id, row.tenant_id, row.request_id, row.created_at,
                              body["prompt"], body["completion"])

    async def shred_tenant(self, tenant_id: str, *, delete_records: bool = True) -> int:
        """Destroy the tenant's data key (crypto-shredding); returns the number of records affected."""
        async with self.engine.begin() as conn:
            await conn.execute(delete(tenant_data_keys).where(tenant_data_keys.c.tenant_id == tenant_id))
            count = len((await conn.execute(select(retained_prompts.c.id).where(
                retained_prompts.c.tenant_id == tenant_id))).all())
            if delete_records:
                await conn.execute(delete(retained_prompts).where(retained_prompts.c.tenant_id == tenant_id))
        return count

    async def purge_expired(self, now: datetime | None = None) -> int:
        async with self.engine.begin() as conn:
            result = await conn.execute(delete(retained_prompts).where(
                retained_prompts.c.expires_at <= (now or datetime.now(UTC))))
        return result.rowcount or 0
