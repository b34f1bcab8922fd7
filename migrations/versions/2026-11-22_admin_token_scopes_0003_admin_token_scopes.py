"""Admin token scopes: extra privileges (``retention:read``) an admin token has only when issued with them.

Revision ID: 0003_admin_token_scopes
Revises: 0002_audit
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_admin_token_scopes"
down_revision = "0002_audit"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing tokens get no extra scopes: reading retained prompts needs a newly issued token.
    op.add_column("admin_tokens", sa.Column("scopes", sa.String(256), nullable=False, server_default=""))


def downgrade() -> None:
    # Batch mode: SQLite rebuilds the table, PostgreSQL runs a plain ALTER TABLE.
    with op.batch_alter_table("admin_tokens") as batch:
        batch.drop_column("scopes")
