"""Admin token lifecycle: an expiry per token, and a scope for every admin route.

Existing tokens keep what they could do (every admin route but reading retained prompts) as explicit
scopes; minting tokens (``tokens:write``) needs a newly issued one. On downgrade the old schema can express
neither an expiry nor a narrower token, so such tokens are revoked rather than widened.

Revision ID: 0005_admin_token_lifecycle
Revises: 0004_inflight_lease
Create Date: 2026-11-25
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0005_admin_token_lifecycle"
down_revision = "0004_inflight_lease"
branch_labels = None
depends_on = None

# Copies, not imports: a migration must not change when the application's constants do.
LEGACY_SCOPES = frozenset(
    {"admin:read", "tenants:write", "policy:write", "keys:write", "audit:export", "metrics:read"}
)
SCOPES_BEFORE = frozenset({"retention:read"})

_TOKENS = sa.table(
    "admin_tokens",
    sa.column("id", sa.String),
    sa.column("scopes", sa.String),
    sa.column("revoked_at", sa.DateTime(timezone=True)),
    sa.column("expires_at", sa.DateTime(timezone=True)),
)


def _set(conn: sa.Connection, token_id: str, **values: object) -> None:
    conn.execute(_TOKENS.update().where(_TOKENS.c.id == token_id).values(**values))


def upgrade() -> None:
    op.add_column("admin_tokens", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    conn = op.get_bind()
    for token_id, scopes in conn.execute(sa.select(_TOKENS.c.id, _TOKENS.c.scopes)).all():
        _set(conn, token_id, scopes=" ".join(sorted(set((scopes or "").split()) | LEGACY_SCOPES)))


def downgrade() -> None:
    conn = op.get_bind()
    now = datetime.now(UTC)
    rows = conn.execute(
        sa.select(_TOKENS.c.id, _TOKENS.c.scopes, _TOKENS.c.revoked_at, _TOKENS.c.expires_at)
    ).all()
    for token_id, scopes, revoked_at, expires_at in rows:
        scope_set = set((scopes or "").split())
        # Before this revision every admin token could do everything in LEGACY_SCOPES, and never expired.
        is_narrower = expires_at is not None or not LEGACY_SCOPES <= scope_set
        values: dict[str, object] = {"scopes": " ".join(sorted(scope_set & SCOPES_BEFORE))}
        if revoked_at is None and is_narrower:
            values["revoked_at"] = now
        _set(conn, token_id, **values)
    with op.batch_alter_table("admin_tokens") as batch:
        batch.drop_column("expires_at")
