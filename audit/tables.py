"""SQLAlchemy Core tables for the audit trail and prompt retention (mirrored by migration 0002)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()

# One row per event; ``seq`` is gapless and assigned under the head lock, so it is also the chain order.
audit_events = Table(
    "audit_events", metadata,
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=False),
    Column("event_id", String(32), nullable=False, unique=True),
    Column("ts", String(32), nullable=False),  # ISO-8601 UTC, exactly as hashed
    Column("name", String(64), nullable=False),
    Column("tenant_id", String(64), nullable=True),
    Column("key_id", String(64), nullable=True),
    Column("request_id", String(64), nullable=True),
    Column("actor", String(128), nullable=True),
    Column("data", Text, nullable=False),  # canonical JSON
    Column("link", String(64), nullable=False),  # SHA-256 public chain (verifiable offline)
    Column("chain_hash", String(64), nullable=False),  # HMAC chain (needs the chain key)
)
Index("ix_audit_events_ts", audit_events.c.ts)
Index("ix_audit_events_tenant_seq", audit_events.c.tenant_id, audit_events.c.seq)

# Signed positions of the chain; kept after purges (they hold hashes only).
audit_checkpoints = Table(
    "audit_checkpoints", metadata,
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=False),
    Column("link", String(64), nullable=False),
    Column("chain_hash", String(64), nullable=False),
    Column("created_at", String(32), nullable=False),
    Column("signature", String(128), nullable=False),  # Ed25519, hex
)

# Exactly one row (id=1): the chain head. Writers lock it first, which serializes appends.
audit_head = Table(
    "audit_head", metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("seq", BigInteger, nullable=False),
    Column("link", String(64), nullable=False),
    Column("chain_hash", String(64), nullable=False),
    Column("num_writes", BigInteger, nullable=False),
)

tenant_data_keys = Table(
    "tenant_data_keys", metadata,
    Column("tenant_id", String(64), primary_key=True),
    Column("wrapped_key", LargeBinary, nullable=False),  # nonce || AES-GCM(master, data key)
    Column("created_at", DateTime(timezone=True), nullable=False),
)

retained_prompts = Table(
    "retained_prompts", metadata,
    Column("id", String(32), primary_key=True),
    Column("tenant_id", String(64), nullable=False),
    Column("request_id", String(64), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("ciphertext", LargeBinary, nullable=False),  # nonce || AES-GCM(data key, JSON record)
)
Index("ix_retained_prompts_tenant", retained_prompts.c.tenant_id)
Index("ix_retained_prompts_expires", retained_prompts.c.expires_at)
