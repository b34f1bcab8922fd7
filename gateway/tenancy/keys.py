"""Tenant API keys and admin tokens: issue, list, revoke, rotate, and authenticate."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection, bindparam, select
from sqlalchemy.ext.asyncio import AsyncSession

from audit.prepared import execute
from gateway.clock import as_utc, utcnow
from gateway.errors import AuthError, InvalidRequest, NotFound
from gateway.principal import Principal
from gateway.schemas.admin import (
    ADMIN_SCOPES,
    LEGACY_SCOPES,
    MAX_EXPIRES_IN_SECONDS,
    RETENTION_READ,  # noqa: F401  (re-exported: where the audit controller and tests take it from)
    KeyCreated,
    KeyOut,
)
from gateway.secrets import ADMIN_PREFIX, TENANT_PREFIX, Hasher, new_token, parse_token
from gateway.storage.models import AdminToken, ApiKey, PolicyVersion, Tenant
from gateway.tenancy.admin_audit import AdminActor
from gateway.tenancy.tenants import get_tenant_row, parse_policy

_DUMMY_HASH = "0" * 64
KEY_CREATED = "admin.key_created"
KEY_REVOKED = "admin.key_revoked"
KEY_ROTATED = "admin.key_rotated"


def key_to_schema(k: ApiKey) -> KeyOut:
    return KeyOut(
        id=k.id,
        tenant_id=k.tenant_id,
        name=k.name,
        created_at=as_utc(k.created_at),
        expires_at=as_utc(k.expires_at),
        revoked_at=as_utc(k.revoked_at),
        rotated_to=k.rotated_to,
    )


def expiry(now: datetime, expires_in_seconds: int | None) -> datetime | None:
    """``now + expires_in_seconds``; ``None`` (never) only when it is omitted.

    Raises:
        InvalidRequest: Zero, negative or above ten years (0 used to mean "never expires").
    """
    if expires_in_seconds is None:
        return None
    if not 0 < expires_in_seconds <= MAX_EXPIRES_IN_SECONDS:
        raise InvalidRequest(
            f"expires_in_seconds must be between 1 and {MAX_EXPIRES_IN_SECONDS}; omit it for no expiry.",
            code="invalid_value",
            param="expires_in_seconds",
        )
    return now + timedelta(seconds=expires_in_seconds)


async def _add_key(
    session: AsyncSession, hasher: Hasher, tenant_id: str, name: str, expires_in_seconds: int | None
) -> tuple[ApiKey, str]:
    """A new key row added to ``session`` (not committed) and the key, which is shown once."""
    now = utcnow()
    expires = expiry(now, expires_in_seconds)
    await get_tenant_row(session, tenant_id)
    key_id, secret, token = new_token(TENANT_PREFIX)
    row = ApiKey(
        id=key_id,
        tenant_id=tenant_id,
        name=name,
        secret_hash=hasher.hash(key_id, secret),
        created_at=now,
        expires_at=expires,
    )
    session.add(row)
    return row, token


async def create_key(
    session: AsyncSession,
    hasher: Hasher,
    by: AdminActor,
    tenant_id: str,
    name: str,
    expires_in_seconds: int | None,
) -> KeyCreated:
    """Issue a tenant key, expiring after ``expires_in_seconds`` (``None``: never).

    Raises:
        InvalidRequest: ``expires_in_seconds`` is not positive.
        NotFound: Unknown tenant.
        AuditUnavailableError: The change could not be audited; no key was issued.
    """
    row, token = await _add_key(session, hasher, tenant_id, name, expires_in_seconds)
    await by.commit(session, KEY_CREATED, tenant_id=tenant_id, key_id=row.id)
    return KeyCreated(key=token, info=key_to_schema(row))


async def _get_key(session: AsyncSession, tenant_id: str, key_id: str) -> ApiKey:
    row = await session.get(ApiKey, key_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound("No such key.", code="key_not_found")
    return row


async def list_keys(session: AsyncSession, tenant_id: str) -> list[KeyOut]:
    await get_tenant_row(session, tenant_id)
    rows = await session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
    )
    return [key_to_schema(k) for k in rows]


async def revoke_key(session: AsyncSession, by: AdminActor, tenant_id: str, key_id: str) -> KeyOut:
    """Revoke a key, effective on its next request (revoking a revoked key changes nothing but is
    recorded all the same)."""
    row = await _get_key(session, tenant_id, key_id)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    await by.commit(session, KEY_REVOKED, tenant_id=tenant_id, key_id=key_id)
    return key_to_schema(row)


async def rotate_key(
    session: AsyncSession, hasher: Hasher, by: AdminActor, tenant_id: str, key_id: str, overlap_seconds: int
) -> KeyCreated:
    """Issue a successor key; the old one keeps working for ``overlap_seconds`` and then expires. The
    successor and the old key's expiry commit together, with one ``admin.key_rotated`` event."""
    old = await _get_key(session, tenant_id, key_id)
    if old.revoked_at is not None:
        raise NotFound("The key is revoked.", code="key_revoked")
    row, token = await _add_key(session, hasher, tenant_id, old.name, None)
    cutoff = utcnow() + timedelta(seconds=overlap_seconds)
    old_expiry = as_utc(old.expires_at)
    old.expires_at = cutoff if old_expiry is None else min(old_expiry, cutoff)
    old.rotated_to = row.id
    await by.commit(session, KEY_ROTATED, tenant_id=tenant_id, key_id=key_id, new_key_id=row.id)
    return KeyCreated(key=token, info=key_to_schema(row))


def new_admin_token(
    hasher: Hasher, name: str, scopes: frozenset[str], expires_in_seconds: int | None = None
) -> tuple[AdminToken, str]:
    """An admin-token row (not yet added to a session) and the token, which is shown once.

    Raises:
        ValueError: An unknown scope.
        InvalidRequest: ``expires_in_seconds`` is not positive.
    """
    unknown = set(scopes) - ADMIN_SCOPES
    if unknown:
        raise ValueError(f"unknown admin scopes {sorted(unknown)}; known: {sorted(ADMIN_SCOPES)}")
    key_id, secret, token = new_token(ADMIN_PREFIX)
    now = utcnow()
    row = AdminToken(
        id=key_id,
        name=name,
        secret_hash=hasher.hash(key_id, secret),
        created_at=now,
        expires_at=expiry(now, expires_in_seconds),
        scopes=" ".join(sorted(scopes)),
    )
    return row, token


async def create_admin_token(
    session: AsyncSession, hasher: Hasher, name: str, scopes: frozenset[str] = LEGACY_SCOPES
) -> str:
    """Issue an admin token with ``scopes`` (default: all but ``retention:read`` and ``tokens:write``).

    Unaudited: for tests and set-up code. ``gateway.tenancy.admin_tokens`` issues audited ones.

    Raises:
        ValueError: An unknown scope.
    """
    row, token = new_admin_token(hasher, name, scopes)
    session.add(row)
    await session.commit()
    return token


async def has_admin_tokens(session: AsyncSession) -> bool:
    return (await session.scalar(select(AdminToken.id).limit(1))) is not None


def _is_live(revoked_at: datetime | None, expires_at: datetime | None, now: datetime) -> bool:
    expiry = as_utc(expires_at)
    return revoked_at is None and (expiry is None or expiry > now)


_KEY = ApiKey.__table__
_CURRENT_POLICY = (
    select(PolicyVersion.body)
    .where(PolicyVersion.tenant_id == _KEY.c.tenant_id)
    .order_by(PolicyVersion.version.desc())
    .limit(1)
    .scalar_subquery()
)
# One round trip: the key, whether its tenant is enabled, and the tenant's current policy.
_TENANT_KEY_ROW = (
    select(
        _KEY.c.id,
        _KEY.c.secret_hash,
        _KEY.c.revoked_at,
        _KEY.c.expires_at,
        _KEY.c.tenant_id,
        Tenant.is_disabled,
        _CURRENT_POLICY.label("policy_body"),
    )
    .select_from(_KEY.outerjoin(Tenant.__table__, Tenant.id == _KEY.c.tenant_id))
    .where(_KEY.c.id == bindparam("key_id"))
)
_ADMIN_ROW = select(
    AdminToken.id, AdminToken.secret_hash, AdminToken.revoked_at, AdminToken.scopes, AdminToken.expires_at
).where(AdminToken.id == bindparam("key_id"))


def authenticate(conn: Connection, hasher: Hasher, token: str) -> Principal:
    """Resolve a bearer token to a principal (with its tenant's current policy) in one query.

    Lookup is by key id with bound parameters only.

    Raises:
        AuthError: with ``code`` saying why (the message is the same for every failure).
    """
    parsed = parse_token(token)
    if parsed is None:
        raise AuthError("Incorrect API key provided.", code="malformed_api_key")
    is_admin = parsed.prefix == ADMIN_PREFIX
    rows = execute(conn, _ADMIN_ROW if is_admin else _TENANT_KEY_ROW, {"key_id": parsed.key_id})
    # Always compute one HMAC so unknown ids and wrong secrets take the same time.
    is_match = hasher.verify(parsed.key_id, parsed.secret, rows[0][1] if rows else _DUMMY_HASH)
    if not rows or not is_match:
        raise AuthError("Incorrect API key provided.", code="invalid_api_key")
    now = utcnow()
    if is_admin:
        key_id, _, revoked_at, scopes, expires_at = rows[0]
        if not _is_live(revoked_at, expires_at, now):
            raise AuthError("Incorrect API key provided.", code="expired_or_revoked_api_key")
        scope_set = frozenset((scopes or "").split())
        return Principal(kind="admin", key_id=key_id, scopes=scope_set, expires_at=as_utc(expires_at))
    key_id, _, revoked_at, expires_at, tenant_id, is_disabled, policy_body = rows[0]
    if not _is_live(revoked_at, expires_at, now):
        raise AuthError("Incorrect API key provided.", code="expired_or_revoked_api_key")
    if is_disabled is None or is_disabled:
        raise AuthError("Incorrect API key provided.", code="tenant_disabled")
    policy = None if policy_body is None else parse_policy(policy_body)
    return Principal(kind="tenant", key_id=key_id, tenant_id=tenant_id, policy=policy)
