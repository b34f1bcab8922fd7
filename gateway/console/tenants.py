"""Console pages for tenants and their API keys, over the same services (and audit events) as the API."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.forms import FormErrors, optional_int, text_fields, validate
from gateway.console.guard import CONSOLE_SCOPE
from gateway.console.session import ConsoleSession
from gateway.console.views import page, see_other
from gateway.errors import ClientError
from gateway.runtime import Runtime
from gateway.schemas.admin import (
    ADMIN_READ,
    KEYS_WRITE,
    TENANTS_WRITE,
    KeyCreate,
    KeyCreated,
    KeyRotate,
    TenantCreate,
)
from gateway.tenancy import keys, tenants
from gateway.tenancy.admin_audit import AdminActor


def by(runtime: Runtime, console: ConsoleSession) -> AdminActor:
    """The signed-in admin token as the author of a change, exactly as on the API."""
    return AdminActor(runtime.audit, console.token_id)


def _errors(e: FormErrors | ClientError) -> list[tuple[str, str]]:
    return e.errors if isinstance(e, FormErrors) else [(e.param or "", e.message)]


async def _tenants_page(session: AsyncSession, request: Request, status: int = 200,
                        errors: list[tuple[str, str]] | None = None, name: str = "") -> Response:
    return page("tenants.html", status, console=request.state.console, csrf=request.state.csrf,
                tenants=await tenants.list_tenants(session), errors=errors or [], name=name,
                can_write=request.state.console.can(TENANTS_WRITE))


async def _tenant_page(session: AsyncSession, request: Request, tenant_id: str, status: int = 200,
                       errors: list[tuple[str, str]] | None = None,
                       created: KeyCreated | None = None) -> Response:
    console: ConsoleSession = request.state.console
    return page("tenant.html", status, console=console, csrf=request.state.csrf,
                tenant=await tenants.get_tenant(session, tenant_id),
                keys=await keys.list_keys(session, tenant_id),
                policy=await tenants.get_policy(session, tenant_id), errors=errors or [], created=created,
                can_write=console.can(TENANTS_WRITE), can_keys=console.can(KEYS_WRITE))


def _key_status(status_code: int, e: FormErrors | ClientError) -> int:
    return e.status_code if isinstance(e, ClientError) else status_code


class TenantsController(Controller):
    path = "/tenants"

    @get("/", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def list_tenants(self, request: Request, session: AsyncSession) -> Response:
        """Every tenant, with the form to add one."""
        return await _tenants_page(session, request)

    @post("/", opt={CONSOLE_SCOPE: TENANTS_WRITE})
    async def create_tenant(self, request: Request, session: AsyncSession, runtime: Runtime,
                            console: ConsoleSession) -> Response:
        """Create a tenant with the server's default policy."""
        name = (await text_fields(request, "name"))["name"].strip()
        try:
            body = validate(TenantCreate, {"name": name})
            created = await tenants.create_tenant(session, by(runtime, console), body.name,
                                                  runtime.settings.default_policy)
        except (FormErrors, ClientError) as e:
            return await _tenants_page(session, request, _key_status(400, e), _errors(e), name)
        return see_other(f"/admin/tenants/{created.id}")

    @post("/{tenant_id:str}/disable", opt={CONSOLE_SCOPE: TENANTS_WRITE})
    async def disable(self, session: AsyncSession, runtime: Runtime, console: ConsoleSession,
                      tenant_id: str) -> Response:
        """Disable a tenant: its keys stop working on their next request."""
        await tenants.set_disabled(session, by(runtime, console), tenant_id, True)
        return see_other(f"/admin/tenants/{tenant_id}")

    @post("/{tenant_id:str}/enable", opt={CONSOLE_SCOPE: TENANTS_WRITE})
    async def enable(self, session: AsyncSession, runtime: Runtime, console: ConsoleSession,
                     tenant_id: str) -> Response:
        """Re-enable a disabled tenant."""
        await tenants.set_disabled(session, by(runtime, console), tenant_id, False)
        return see_other(f"/admin/tenants/{tenant_id}")

    @get("/{tenant_id:str}", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def tenant(self, request: Request, session: AsyncSession, tenant_id: str) -> Response:
        """One tenant: its keys and current policy."""
        return await _tenant_page(session, request, tenant_id)

    @post("/{tenant_id:str}/keys", opt={CONSOLE_SCOPE: KEYS_WRITE})
    async def create_key(self, request: Request, session: AsyncSession, runtime: Runtime,
                         console: ConsoleSession, tenant_id: str) -> Response:
        """Issue a key; the page that answers is the only place its secret is ever shown."""
        fields = await text_fields(request, "name", "expires_in_seconds")
        try:
            expires = optional_int(fields["expires_in_seconds"], "expires_in_seconds")
            body = validate(KeyCreate, {"name": fields["name"].strip(), "expires_in_seconds": expires})
            created = await keys.create_key(session, runtime.hasher, by(runtime, console), tenant_id,
                                            body.name, body.expires_in_seconds)
        except (FormErrors, ClientError) as e:
            return await _tenant_page(session, request, tenant_id, _key_status(400, e), _errors(e))
        return await _tenant_page(session, request, tenant_id, 201, created=created)

    @post("/{tenant_id:str}/keys/{key_id:str}/revoke", opt={CONSOLE_SCOPE: KEYS_WRITE})
    async def revoke_key(self, session: AsyncSession, runtime: Runtime, console: ConsoleSession,
                         tenant_id: str, key_id: str) -> Response:
        """Revoke a key, effective on its next request."""
        await keys.revoke_key(session, by(runtime, console), tenant_id, key_id)
        return see_other(f"/admin/tenants/{tenant_id}")

    @post("/{tenant_id:str}/keys/{key_id:str}/rotate", opt={CONSOLE_SCOPE: KEYS_WRITE})
    async def rotate_key(self, request: Request, session: AsyncSession, runtime: Runtime,
                         console: ConsoleSession, tenant_id: str, key_id: str) -> Response:
        """Issue a successor key; the old one keeps working for the overlap, then expires."""
        fields = await text_fields(request, "overlap_seconds")
        try:
            overlap = optional_int(fields["overlap_seconds"], "overlap_seconds")
            body = validate(KeyRotate, {} if overlap is None else {"overlap_seconds": overlap})
            created = await keys.rotate_key(session, runtime.hasher, by(runtime, console), tenant_id, key_id,
                                            body.overlap_seconds)
        except (FormErrors, ClientError) as e:
            return await _tenant_page(session, request, tenant_id, _key_status(400, e), _errors(e))
        return await _tenant_page(session, request, tenant_id, 201, created=created)

