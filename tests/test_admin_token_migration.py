"""Migration 0005: existing admin tokens keep what they could do; a downgrade never widens a token."""

from datetime import timedelta

from sqlalchemy import text

from gateway.clock import utcnow
from gateway.schemas.admin import ADMIN_READ, LEGACY_SCOPES, RETENTION_READ, ROUTES_WRITE
from gateway.storage import migrate
from gateway.storage.db import make_db_engine
from tests.gateway.conftest import db_url, pg_user  # noqa: F401  (fixtures)

BEFORE = "0004_inflight_lease"


async def _sql(url: str, statement: str, **params: object) -> list[tuple]:
    engine = make_db_engine(url, null_pool=True)
    try:
        async with engine.begin() as conn:
            result = await conn.execute(text(statement), params)
            return [tuple(r) for r in result.all()] if result.returns_rows else []
    finally:
        await engine.dispose()


async def _add(url: str, token_id: str, scopes: str, **extra: object) -> None:
    columns = ", ".join(["id", "name", "secret_hash", "created_at", "scopes", *extra])
    values = ", ".join(f":{c}" for c in ["id", "name", "secret_hash", "created_at", "scopes", *extra])
    await _sql(url, f"INSERT INTO admin_tokens ({columns}) VALUES ({values})", id=token_id, name="",
               secret_hash="0" * 64, created_at=utcnow(), scopes=scopes, **extra)


async def _tokens(url: str) -> dict[str, tuple[str, bool]]:
    rows = await _sql(url, "SELECT id, scopes, revoked_at FROM admin_tokens")
    return {token_id: (scopes, revoked_at is not None) for token_id, scopes, revoked_at in rows}


async def test_upgrade_keeps_old_powers_and_downgrade_revokes_what_it_cannot_express(db_url):  # noqa: F811
    await migrate.downgrade(db_url, BEFORE)
    await _add(db_url, "plain", "")
    await _add(db_url, "reader", RETENTION_READ)
    await migrate.upgrade(db_url)
    # routes:write came after 0005 (routes were a policy editor's until then): 0005 never grants it
    legacy_0005 = LEGACY_SCOPES - {ROUTES_WRITE}
    legacy = " ".join(sorted(legacy_0005))
    assert await _tokens(db_url) == {
        "plain": (legacy, False), "reader": (" ".join(sorted(legacy_0005 | {RETENTION_READ})), False)
    }
    await _add(db_url, "narrow", ADMIN_READ)
    await _add(db_url, "expiring", legacy, expires_at=utcnow() + timedelta(days=1))
    await migrate.downgrade(db_url, BEFORE)
    assert await _tokens(db_url) == {
        "plain": ("", False), "reader": (RETENTION_READ, False), "narrow": ("", True), "expiring": ("", True)
    }
