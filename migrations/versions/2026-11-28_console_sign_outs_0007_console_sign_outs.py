"""Console sign-outs: the sessions signed out before their expiry, shared by every replica.

Revision ID: 0007_console_sign_outs
Revises: 0006_model_routes
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_console_sign_outs"
down_revision = "0006_model_routes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_sign_outs",
        sa.Column("sid", sa.String(64), primary_key=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_console_sign_outs_expires_at", "console_sign_outs", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_sign_outs_expires_at", table_name="console_sign_outs")
    op.drop_table("console_sign_outs")
