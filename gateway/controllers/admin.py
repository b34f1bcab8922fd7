"""Admin API under ``/admin/v1``: tenants, keys, policies, usage and admin tokens (scoped admin tokens)."""

from __future__ import annotations

from datetime import datetime

from litestar import Controller, Request, Response, get, post, put
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.body import parse_body
from gateway.guards import requires_admin
from gateway.openapi import Body, Reply, route_doc
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.admin import (
    AdminTokenCreate,
    AdminTokenCreated,
    AdminTokenOut,
    EngineShareOut,
    KeyCreate,
    KeyCreated,
    KeyOut,
    KeyRotate,
    PolicyOut,
    PolicyPut,
    TenantCreate,
    TenantOut,
    UsageRow,
)
from gateway.tenancy import admin_tokens, keys, tenants, usage
from gateway.tenancy.admin_audit import AdminActor


def _by(runtime: Runtime, principal: Principal) -> AdminActor:
    """The calling admin token as the author of a change: its event commits with the change (503 and no
    change when the audit trail cannot record it)."""
    return AdminActor(runtime.audit, principal.key_id)


_USAGE = Reply("Usage rows: JSON, or CSV with format=csv.", (Body(list[UsageRow]), Body(str, "text/csv")))


class AdminController(Controller):
    path = "/admin/v1"
    guards = [requires_admin]

    @post("/tenants", status_code=201, opt=route_doc(request=TenantCreate, errors=(409,)))
    async def create_tenant(
        self, request: Request, session: AsyncSession, runtime: Runtime, principal: Principal
    ) -> TenantOut:
        """Create a tenant with the settings' default policy (or the one given) as version 1."""
        body = parse_body(await request.body(), TenantCreate)
        policy = body.policy or runtime.settings.default_policy
        return await tenants.create_tenant(session, _by(runtime, principal), body.name, policy)

    @get("/tenants")
    async def list_tenants(self, session: AsyncSession) -> list[TenantOut]:
        """List all tenants."""
        return await tenants.list_tenants(session)

    @get("/tenants/{tenant_id:str}")
    async def get_tenant(self, session: AsyncSession, tenant_id: str) -> TenantOut:
        """Get one tenant."""
        return await tenants.get_tenant(session, tenant_id)

    @post("/tenants/{tenant_id:str}/disable", status_code=200)
    async def disable_tenant(
        self, session: AsyncSession, runtime: Runtime, principal: Principal, tenant_id: str
    ) -> TenantOut:
        """Disable a tenant: its keys stop working on the next request."""
        return await tenants.set_disabled(session, _by(runtime, principal), tenant_id, True)

    @post("/tenants/{tenant_id:str}/enable", status_code=200)
    async def enable_tenant(
        self, session: AsyncSession, runtime: Runtime, principal: Principal, tenant_id: str
    ) -> TenantOut:
        """Re-enable a disabled tenant."""
        return await tenants.set_disabled(session, _by(runtime, principal), tenant_id, False)

    @post(
        "/tenants/{tenant_id:str}/keys",
        status_code=201,
        opt=route_doc(request=KeyCreate, is_request_optional=True),
    )
    async def create_key(
        self, request: Request, session: AsyncSession, runtime: Runtime, principal: Principal, tenant_id: str
    ) -> KeyCreated:
        """Issue an API key; the full key is in this response only."""
        body = parse_body(await request.body() or b"{}", KeyCreate)
        by = _by(runtime, principal)
        return await keys.create_key(
            session, runtime.hasher, by, tenant_id, body.name, body.expires_in_seconds
        )

    @get("/tenants/{tenant_id:str}/keys")
    async def list_keys(self, session: AsyncSession, tenant_id: str) -> list[KeyOut]:
        """List a tenant's keys (never their secrets)."""
        return await keys.list_keys(session, tenant_id)

    @post("/tenants/{tenant_id:str}/keys/{key_id:str}/revoke", status_code=200)
    async def revoke_key(
        self, session: AsyncSession, runtime: Runtime, principal: Principal, tenant_id: str, key_id: str
    ) -> KeyOut:
        """Revoke a key, effective on its next request."""
        return await keys.revoke_key(session, _by(runtime, principal), tenant_id, key_id)

    @post(
        "/tenants/{tenant_id:str}/keys/{key_id:str}/rotate",
        status_code=201,
        opt=route_doc(request=KeyRotate, is_request_optional=True),
    )
    async def rotate_key(
        self,
        request: Request,
        session: AsyncSession,
        runtime: Runtime,
        principal: Principal,
        tenant_id: str,
        key_id: str,
    ) -> KeyCreated:
        """Issue a successor key; the old one keeps working for ``overlap_seconds``."""
        body = parse_body(await request.body() or b"{}", KeyRotate)
        by = _by(runtime, principal)
        return await keys.rotate_key(session, runtime.hasher, by, tenant_id, key_id, body.overlap_seconds)

    @get("/tenants/{tenant_id:str}/policy")
    async def get_policy(self, session: AsyncSession, tenant_id: str) -> PolicyOut:
        """The tenant's current policy version."""
        return await tenants.get_policy(session, tenant_id)

    @get("/tenants/{tenant_id:str}/policy/history")
    async def policy_history(self, session: AsyncSession, tenant_id: str) -> list[PolicyOut]:
        """Every policy version, oldest first, with who changed it."""
        return await tenants.policy_history(session, tenant_id)

    @put("/tenants/{tenant_id:str}/policy", opt=route_doc(request=PolicyPut, errors=(409,)))
    async def put_policy(
        self, request: Request, session: AsyncSession, runtime: Runtime, principal: Principal, tenant_id: str
    ) -> PolicyOut:
        """Validate and store a new policy version (409 if ``expected_version`` is stale)."""
        body = parse_body(await request.body(), PolicyPut)
        by = _by(runtime, principal)
        return await tenants.put_policy(
            session, by, tenant_id, body.policy, body.comment, body.expected_version
        )

    @get("/tenants/{tenant_id:str}/usage", opt=route_doc(responses={200: _USAGE}))
    async def get_usage(
        self,
        session: AsyncSession,
        tenant_id: str,
        window: str = "day",
        start: datetime | None = None,
        end: datetime | None = None,
        format: str = "json",
    ) -> Response:
        """Settled usage per window; ``format=csv`` returns CSV."""
        rows: list[UsageRow] = await usage.usage_report(session, tenant_id, window, start, end)
        if format == "csv":
            return Response(usage.to_csv(rows), media_type="text/csv")
        return Response([r.model_dump(mode="json") for r in rows])

    @get("/tenants/{tenant_id:str}/engine", opt=route_doc(errors=(404,)))
    async def get_engine_share(
        self, session: AsyncSession, runtime: Runtime, tenant_id: str
    ) -> EngineShareOut:
        """The tenant's requests waiting and running in the engine, the KV blocks they hold, and its recent
        share of the engine's step time, now."""
        await tenants.get_tenant(session, tenant_id)  # 404 for an unknown tenant
        figures = runtime.engine.stats().tenants.get(tenant_id.encode(), {})
        return EngineShareOut(tenant_id=tenant_id, waiting=figures.get("waiting", 0),
                              running=figures.get("running", 0), kv_blocks=figures.get("kv_blocks", 0),
                              step_share=figures.get("step_share", 0.0))

    @get("/admin-tokens")
    async def list_admin_tokens(self, session: AsyncSession) -> list[AdminTokenOut]:
        """List every admin token with its scopes and expiry (never the tokens themselves)."""
        return await admin_tokens.list_tokens(session)

    @post("/admin-tokens", status_code=201, opt=route_doc(request=AdminTokenCreate))
    async def create_admin_token(
        self, request: Request, session: AsyncSession, runtime: Runtime, principal: Principal
    ) -> AdminTokenCreated:
        """Issue an admin token; the token is in this response only.

        Args:
            request: ``{"name", "scopes": [...], "expires_in_seconds"}``; omit the expiry for none.

        Raises:
            InvalidRequest: Unknown scope, no scope, or an expiry that is not positive (400).
            Forbidden: A scope the calling token lacks, or an expiry past its own (403).
        """
        body = parse_body(await request.body(), AdminTokenCreate)
        return await admin_tokens.mint(session, runtime.hasher, runtime.audit, principal, body)

    @post("/admin-tokens/{token_id:str}/revoke", status_code=200)
    async def revoke_admin_token(
        self, session: AsyncSession, runtime: Runtime, principal: Principal, token_id: str
    ) -> AdminTokenOut:
        """Revoke an admin token, effective on its next request.

        Raises:
            NotFound: No such token (404).
            Forbidden: The token has scopes the calling token lacks (403).
        """
        return await admin_tokens.revoke(session, _by(runtime, principal), token_id, principal)
