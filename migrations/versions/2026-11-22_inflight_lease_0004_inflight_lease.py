"""In-flight request slots held per gateway instance under a heartbeat lease.

A crashed gateway used to leave ``tenants.num_in_flight`` raised forever. Slots now live in
``tenant_in_flight`` rows per (tenant, instance), and count only while their instance's
``gateway_instances.heartbeat_at`` is recent, so a dead instance's slots lapse on their own.

Revision ID: 0004_inflight_lease
Revises: 0003_admin_token_scopes
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_inflight_lease"
down_revision = "0003_admin_token_scopes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_instances",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("started_at", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "tenant_in_flight",
        sa.Column(
            "tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column(
            "instance_id",
            sa.String(32),
            sa.ForeignKey("gateway_instances.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("num_in_flight", sa.Integer, nullable=False, server_default="0"),
    )
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("num_in_flight")


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("num_in_flight", sa.Integer, nullable=False, server_default="0"))
    op.drop_table("tenant_in_flight")
    op.drop_table("gateway_instances")
