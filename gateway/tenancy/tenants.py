"""Tenants and their versioned policies; every change committed with its audit event."""

from __future__ import annotations

import secrets
from functools import lru_cache

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.clock import as_utc, utcnow
from gateway.errors import Conflict, NotFound
from gateway.schemas.admin import PolicyOut, TenantOut
from gateway.storage.models import PolicyVersion, Tenant
from gateway.tenancy.admin_audit import AdminActor
from policies import Policy

TENANT_CREATED = "admin.tenant_created"
TENANT_DISABLED = "admin.tenant_disabled"
TENANT_ENABLED = "admin.tenant_enabled"
POLICY_CHANGED = "admin.policy_changed"


def tenant_to_schema(t: Tenant) -> TenantOut:
    return TenantOut(id=t.id, name=t.name, is_disabled=t.is_disabled, created_at=as_utc(t.created_at))


def policy_to_schema(p: PolicyVersion) -> PolicyOut:
    return PolicyOut(
        tenant_id=p.tenant_id,
        version=p.version,
        policy=Policy.model_validate_json(p.body),
        changed_by=p.changed_by,
        comment=p.comment,
        created_at=as_utc(p.created_at),
    )


async def create_tenant(session: AsyncSession, by: AdminActor, name: str, policy: Policy) -> TenantOut:
    """Create a tenant with ``policy`` as its version 1.

    Raises:
        Conflict: The name is taken (409).
        AuditUnavailableError: The change could not be audited; nothing was created.
    """
    tenant = Tenant(id=secrets.token_hex(8), name=name, is_disabled=False, created_at=utcnow())
    session.add(tenant)
    try:
        await session.flush()
    except IntegrityError as e:
        await session.rollback()
        raise Conflict(f"A tenant named {name!r} already exists.", code="tenant_exists") from e
    session.add(
        PolicyVersion(
            tenant_id=tenant.id,
            version=1,
            body=policy.model_dump_json(),
            changed_by=by.id,
            comment="initial",
            created_at=utcnow(),
        )
    )
    await by.commit(session, TENANT_CREATED, tenant_id=tenant.id)
    return tenant_to_schema(tenant)


async def get_tenant_row(session: AsyncSession, tenant_id: str) -> Tenant:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound("No such tenant.", code="tenant_not_found")
    return tenant


async def get_tenant(session: AsyncSession, tenant_id: str) -> TenantOut:
    return tenant_to_schema(await get_tenant_row(session, tenant_id))


async def list_tenants(session: AsyncSession) -> list[TenantOut]:
    rows = await session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id))
    return [tenant_to_schema(t) for t in rows]


async def set_disabled(session: AsyncSession, by: AdminActor, tenant_id: str, is_disabled: bool) -> TenantOut:
    """Disable (its keys stop working on their next request) or re-enable a tenant."""
    tenant = await get_tenant_row(session, tenant_id)
    tenant.is_disabled = is_disabled
    await by.commit(session, TENANT_DISABLED if is_disabled else TENANT_ENABLED, tenant_id=tenant_id)
    return tenant_to_schema(tenant)


async def _current_row(session: AsyncSession, tenant_id: str) -> PolicyVersion | None:
    stmt = (
        select(PolicyVersion)
        .where(PolicyVersion.tenant_id == tenant_id)
        .order_by(PolicyVersion.version.desc())
        .limit(1)
    )
    return (await session.scalars(stmt)).first()


async def get_policy(session: AsyncSession, tenant_id: str) -> PolicyOut:
    await get_tenant_row(session, tenant_id)
    row = await _current_row(session, tenant_id)
    if row is None:
        raise NotFound("This tenant has no policy.", code="policy_not_found")
    return policy_to_schema(row)


@lru_cache(maxsize=4096)
def parse_policy(body: str) -> Policy:
    """Parse stored policy JSON; cached, as policies are immutable and each version's body never changes."""
    return Policy.model_validate_json(body)


async def current_policy(session: AsyncSession, tenant_id: str, default: Policy) -> Policy:
    row = await _current_row(session, tenant_id)
    return default if row is None else parse_policy(row.body)


async def policy_history(session: AsyncSession, tenant_id: str) -> list[PolicyOut]:
    await get_tenant_row(session, tenant_id)
    rows = await session.scalars(
        select(PolicyVersion).where(PolicyVersion.tenant_id == tenant_id).order_by(PolicyVersion.version)
    )
    return [policy_to_schema(r) for r in rows]


async def put_policy(
    session: AsyncSession,
    by: AdminActor,
    tenant_id: str,
    policy: Policy,
    comment: str,
    expected_version: int | None = None,
) -> PolicyOut:
    """Append a new policy version; the (tenant, version) unique constraint makes racing writers conflict.

    Raises:
        NotFound: Unknown tenant (404).
        Conflict: ``expected_version`` is stale, or another writer won the race (409).
    """
    await get_tenant_row(session, tenant_id)
    latest = (
        await session.scalar(
            select(func.max(PolicyVersion.version)).where(PolicyVersion.tenant_id == tenant_id)
        )
        or 0
    )
    if expected_version is not None and expected_version != latest:
        raise Conflict(f"Policy is at version {latest}, not {expected_version}.", code="version_conflict")
    row = PolicyVersion(
        tenant_id=tenant_id,
        version=latest + 1,
        body=policy.model_dump_json(),
        changed_by=by.id,
        comment=comment,
        created_at=utcnow(),
    )
    session.add(row)
    try:
        await by.commit(session, POLICY_CHANGED, tenant_id=tenant_id, version=row.version)
    except IntegrityError as e:
        await session.rollback()
        raise Conflict("The policy was changed concurrently; retry.", code="version_conflict") from e
    return policy_to_schema(row)
