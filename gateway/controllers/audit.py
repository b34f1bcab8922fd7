"""Admin API for the audit trail and prompt retention under ``/admin/v1`` (admin tokens only)."""

from __future__ import annotations

from litestar import Controller, get, post
from litestar.response import Stream
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.guards import requires_admin, requires_scope
from gateway.inference import retention
from gateway.openapi import Body, Reply, route_doc
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.audit import PurgeOut, RetainedInfo, RetainedRecordOut, ShredOut
from gateway.tenancy import audit_export
from gateway.tenancy.keys import RETENTION_READ

_TAR = "application/x-tar"


class AuditController(Controller):
    path = "/admin/v1"
    guards = [requires_admin]

    @get("/audit/export", opt=route_doc(responses={200: Reply("The signed bundle.", (Body(bytes, _TAR),))}))
    async def export(
        self,
        session: AsyncSession,
        runtime: Runtime,
        principal: Principal,
        since: str | None = None,
        until: str | None = None,
        tenant: str | None = None,
        format: str = "jsonl",
    ) -> Stream:
        """Stream a signed audit bundle (a ``.tar`` that ``kvgate audit verify`` checks offline).

        Args:
            since: Start, inclusive (ISO-8601; a naive time is UTC).
            until: End, exclusive.
            tenant: Only this tenant's events, with the chain proofs that keep them verifiable.
            format: ``jsonl`` or ``csv`` for the events file.

        Returns:
            ``application/x-tar``: manifest, its Ed25519 signature, public key, events and chain proofs.

        Raises:
            InvalidRequest: Bad dates, ``until`` before ``since``, unknown format or tenant (400).
            AuditUnavailableError: The audit store is unavailable (503); nothing is streamed.
        """
        spec = await audit_export.parse_export_query(session, since, until, tenant, format)
        return await audit_export.export_response(runtime, principal, spec)

    @get("/tenants/{tenant_id:str}/retention")
    async def list_retained(
        self, session: AsyncSession, runtime: Runtime, tenant_id: str, limit: int = 100
    ) -> list[RetainedInfo]:
        """List a tenant's retained prompt records, newest first (metadata only, nothing decrypted).

        Raises:
            NotFound: Unknown tenant (404).
        """
        return await retention.list_records(runtime, session, tenant_id, limit)

    @get("/tenants/{tenant_id:str}/retention/{record_id:str}", guards=[requires_scope(RETENTION_READ)])
    async def read_retained(
        self,
        runtime: Runtime,
        principal: Principal,
        tenant_id: str,
        record_id: str,
        reason: str | None = None,
    ) -> RetainedRecordOut:
        """Decrypt one retained record; needs a token with the ``retention:read`` scope and a reason.

        Args:
            reason: Why the record is read (4 to 256 characters); recorded in the audit trail.

        Raises:
            Forbidden: The admin token lacks the ``retention:read`` scope (403).
            NotFound: Unknown, expired or crypto-shredded record (404).
            AuditUnavailableError: The read could not be audited (503); nothing is decrypted.
        """
        return await retention.read_record(runtime, principal, tenant_id, record_id, reason)

    @post("/tenants/{tenant_id:str}/retention/shred", status_code=200)
    async def shred_retained(
        self, session: AsyncSession, runtime: Runtime, principal: Principal, tenant_id: str
    ) -> ShredOut:
        """Crypto-shred: delete the tenant's data key, so its retained records are unreadable at once.

        Raises:
            NotFound: Unknown tenant (404).
            AuditUnavailableError: The shred could not be audited (503); nothing is deleted.
        """
        return await retention.shred(runtime, session, principal, tenant_id)

    @post("/retention/purge", status_code=200)
    async def purge_retained(self, runtime: Runtime, principal: Principal) -> PurgeOut:
        """Delete every expired retained record (expired records are already unreadable)."""
        return await retention.purge_expired(runtime, principal.key_id)
