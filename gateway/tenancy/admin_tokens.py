"""Admin tokens: issue (never beyond the caller's own scopes or lifetime), list and revoke, all audited."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.audit_hook import AuditHook
from gateway.clock import as_utc, utcnow
from gateway.errors import Forbidden, NotFound
from gateway.principal import Principal
from gateway.schemas.admin import AdminTokenCreate, AdminTokenCreated, AdminTokenOut
from gateway.secrets import Hasher
from gateway.storage.models import AdminToken
from gateway.tenancy.admin_audit import AdminActor
from gateway.tenancy.keys import expiry, new_admin_token

TOKEN_CREATED = "admin.admin_token_created"
TOKEN_REVOKED = "admin.admin_token_revoked"
_SNAPSHOT = {"name", "scopes", "expires_at", "revoked_at"}


def _scopes(row: AdminToken) -> list[str]:
    return sorted((row.scopes or "").split())


def token_to_schema(row: AdminToken) -> AdminTokenOut:
    return AdminTokenOut(
        id=row.id,
        name=row.name,
        scopes=_scopes(row),
        created_at=as_utc(row.created_at),
        expires_at=as_utc(row.expires_at),
        revoked_at=as_utc(row.revoked_at),
    )


async def _commit_audited(session: AsyncSession, by: AdminActor, name: str, row: AdminToken) -> None:
    after = token_to_schema(row).model_dump(mode="json", include=_SNAPSHOT)
    fields: dict[str, Any] = {"target_type": "admin_token", "target_id": row.id, "after": after}
    await by.commit(session, name, **fields)


async def issue(
    session: AsyncSession, hasher: Hasher, by: AdminActor, body: AdminTokenCreate
) -> AdminTokenCreated:
    """Issue a token with ``body.scopes``, unchecked against any caller (the CLI, which owns the database).

    Raises:
        InvalidRequest: ``expires_in_seconds`` is not positive.
        AuditUnavailableError: The audit trail could not record it; no token was issued.
    """
    row, token = new_admin_token(hasher, body.name, frozenset(body.scopes), body.expires_in_seconds)
    session.add(row)
    await _commit_audited(session, by, TOKEN_CREATED, row)
    return AdminTokenCreated(token=token, info=token_to_schema(row))


def _check_within(caller: Principal, scopes: frozenset[str], action: str) -> None:
    missing = sorted(scopes - caller.scopes)
    if missing:
        message = f"This admin token cannot {action} a token with scopes it lacks: {missing}."
        raise Forbidden(message, code="scope_required")


async def mint(
    session: AsyncSession, hasher: Hasher, audit: AuditHook, caller: Principal, body: AdminTokenCreate
) -> AdminTokenCreated:
    """Issue a token for ``caller``: only scopes the caller has, expiring no later than the caller does.

    Raises:
        Forbidden: A scope the caller lacks, or an expiry past the caller's own (403).
        InvalidRequest: ``expires_in_seconds`` is not positive (400).
    """
    _check_within(caller, frozenset(body.scopes), "issue")
    if caller.expires_at is not None:
        expires = expiry(utcnow(), body.expires_in_seconds)
        if expires is None or expires > caller.expires_at:
            raise Forbidden(
                "A token cannot outlive the token that issues it; ask for a shorter expires_in_seconds.",
                code="token_outlives_issuer",
            )
    return await issue(session, hasher, AdminActor(audit, caller.key_id), body)


async def list_tokens(session: AsyncSession) -> list[AdminTokenOut]:
    """Every admin token, oldest first (never secrets)."""
    rows = await session.scalars(select(AdminToken).order_by(AdminToken.created_at, AdminToken.id))
    return [token_to_schema(r) for r in rows]


async def revoke(
    session: AsyncSession, by: AdminActor, token_id: str, caller: Principal | None = None
) -> AdminTokenOut:
    """Revoke a token, effective on its next request. ``caller`` (``None``: the CLI, which owns the
    database) must hold every scope the token has, so a narrow token cannot lock out a broader one.

    Raises:
        NotFound: No such token (404).
        Forbidden: The token has scopes the caller lacks (403).
    """
    row = await session.get(AdminToken, token_id)
    if row is None:
        raise NotFound("No such admin token.", code="admin_token_not_found")
    if caller is not None:
        _check_within(caller, frozenset(_scopes(row)), "revoke")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    await _commit_audited(session, by, TOKEN_REVOKED, row)
    return token_to_schema(row)
