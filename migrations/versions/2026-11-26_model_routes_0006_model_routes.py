"""Model routes: served models that go to an upstream pool (vLLM, SGLang, llama.cpp, another kvgate),
versioned as policies are.

Revision ID: 0006_model_routes
Revises: 0005_admin_token_lifecycle
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_model_routes"
down_revision = "0005_admin_token_lifecycle"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_routes",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("api_key_sealed", sa.Text, nullable=True),
        sa.Column("is_deleted", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("changed_by", sa.String(64), nullable=False),
        sa.Column("comment", sa.String(512), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("name", "version"),
    )
    op.create_index("ix_model_routes_name", "model_routes", ["name"])


def downgrade() -> None:
    op.drop_index("ix_model_routes_name", table_name="model_routes")
    op.drop_table("model_routes")
