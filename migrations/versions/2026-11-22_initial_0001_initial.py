"""Initial gateway schema: tenants, api_keys, policies, usage_counters, admin_tokens.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    _create_tenants_and_keys()
    _create_policies_usage_and_admin()


def _create_tenants_and_keys() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("is_disabled", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("num_in_flight", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column(
            "tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("name", sa.String(128), nullable=False, server_default=""),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=True),
        sa.Column("revoked_at", _TS, nullable=True),
        sa.Column("rotated_to", sa.String(32), nullable=True),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])


def _create_policies_usage_and_admin() -> None:
    op.create_table(
        "policies",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("changed_by", sa.String(64), nullable=False),
        sa.Column("comment", sa.String(512), nullable=False, server_default=""),
        sa.Column("created_at", _TS, nullable=False),
        sa.UniqueConstraint("tenant_id", "version"),
    )
    op.create_index("ix_policies_tenant_id", "policies", ["tenant_id"])
    op.create_table(
        "usage_counters",
        sa.Column(
            "tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("window", sa.String(8), primary_key=True),
        sa.Column("window_start", sa.BigInteger, primary_key=True),
        sa.Column("num_requests", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("num_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("num_prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("num_completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("num_cached_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "admin_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, server_default=""),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("revoked_at", _TS, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("admin_tokens")
    op.drop_table("usage_counters")
    op.drop_index("ix_policies_tenant_id", table_name="policies")
    op.drop_table("policies")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
