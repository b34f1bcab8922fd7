"""Audit trail (events, checkpoints, head) and encrypted prompt retention.

Mirrors ``audit.tables`` (kept separate: migrations never import application code).

Revision ID: 0002_audit
Revises: 0001_initial
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_audit"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

_SEQ = sa.BigInteger().with_variant(sa.Integer, "sqlite")
_TS = sa.DateTime(timezone=True)
_GENESIS = "00" * 32


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("seq", _SEQ, primary_key=True, autoincrement=False),
        sa.Column("event_id", sa.String(32), nullable=False, unique=True),
        sa.Column("ts", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=True),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("actor", sa.String(128), nullable=True),
        sa.Column("data", sa.Text, nullable=False),
        sa.Column("link", sa.String(64), nullable=False),
        sa.Column("chain_hash", sa.String(64), nullable=False),
    )
    op.create_index("ix_audit_events_ts", "audit_events", ["ts"])
    op.create_index("ix_audit_events_tenant_seq", "audit_events", ["tenant_id", "seq"])
    op.create_table(
        "audit_checkpoints",
        sa.Column("seq", _SEQ, primary_key=True, autoincrement=False),
        sa.Column("link", sa.String(64), nullable=False),
        sa.Column("chain_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
    )
    head = op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("link", sa.String(64), nullable=False),
        sa.Column("chain_hash", sa.String(64), nullable=False),
        sa.Column("num_writes", sa.BigInteger, nullable=False),
    )
    # The single head row every writer locks; created here so two first writers cannot race on it.
    op.bulk_insert(head, [{"id": 1, "seq": 0, "link": _GENESIS, "chain_hash": _GENESIS, "num_writes": 0}])
    op.create_table(
        "tenant_data_keys",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("wrapped_key", sa.LargeBinary, nullable=False),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_table(
        "retained_prompts",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
        sa.Column("ciphertext", sa.LargeBinary, nullable=False),
    )
    op.create_index("ix_retained_prompts_tenant", "retained_prompts", ["tenant_id"])
    op.create_index("ix_retained_prompts_expires", "retained_prompts", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_retained_prompts_expires", table_name="retained_prompts")
    op.drop_index("ix_retained_prompts_tenant", table_name="retained_prompts")
    op.drop_table("retained_prompts")
    op.drop_table("tenant_data_keys")
    op.drop_table("audit_head")
    op.drop_table("audit_checkpoints")
    op.drop_index("ix_audit_events_tenant_seq", table_name="audit_events")
    op.drop_index("ix_audit_events_ts", table_name="audit_events")
    op.drop_table("audit_events")
