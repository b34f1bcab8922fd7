"""Authorization guards: tenant keys only on ``/v1``; on ``/admin`` and ``/metrics`` admin tokens holding the
scope each route needs.

Guards are coroutine functions although they never await: Litestar runs a plain function guard in a
worker thread (``AsyncCallable``), a thread round trip on every request for a dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import Forbidden
from gateway.principal import Principal
from gateway.schemas.admin import (
    ADMIN_READ,
    AUDIT_EXPORT,
    KEYS_WRITE,
    METRICS_READ,
    POLICY_WRITE,
    RETENTION_READ,
    ROUTES_WRITE,
    TENANTS_WRITE,
    TOKENS_WRITE,
)

_TENANT = "/admin/v1/tenants/{tenant_id}"
# The scope each admin route needs, by (method, route template): the one authorization table (docs/
# security.md shows it to users). A route missing here is refused to every token, so a new admin route
# stays closed until it is given a scope; tests/gateway/test_admin_scopes.py checks the table against the
# app's routes. OPTIONS (which methods a path takes) needs ``admin:read``.
ADMIN_ROUTE_SCOPES: dict[tuple[str, str], str] = {
    ("GET", "/admin/v1/tenants"): ADMIN_READ,
    ("GET", _TENANT): ADMIN_READ,
    ("GET", f"{_TENANT}/keys"): ADMIN_READ,
    ("GET", f"{_TENANT}/policy"): ADMIN_READ,
    ("GET", f"{_TENANT}/policy/history"): ADMIN_READ,
    ("GET", f"{_TENANT}/usage"): ADMIN_READ,
    ("GET", f"{_TENANT}/engine"): ADMIN_READ,
    ("GET", f"{_TENANT}/retention"): ADMIN_READ,
    ("GET", "/admin/v1/admin-tokens"): ADMIN_READ,
    ("GET", "/admin/v1/models"): ADMIN_READ,
    ("GET", "/admin/v1/models/{name}"): ADMIN_READ,
    ("GET", "/admin/v1/model-history/{name}"): ADMIN_READ,
    ("PUT", "/admin/v1/models/{name}"): ROUTES_WRITE,
    ("DELETE", "/admin/v1/models/{name}"): ROUTES_WRITE,
    ("POST", "/admin/v1/tenants"): TENANTS_WRITE,
    ("POST", f"{_TENANT}/disable"): TENANTS_WRITE,
    ("POST", f"{_TENANT}/enable"): TENANTS_WRITE,
    ("PUT", f"{_TENANT}/policy"): POLICY_WRITE,
    ("POST", f"{_TENANT}/keys"): KEYS_WRITE,
    ("POST", f"{_TENANT}/keys/{{key_id}}/revoke"): KEYS_WRITE,
    ("POST", f"{_TENANT}/keys/{{key_id}}/rotate"): KEYS_WRITE,
    ("POST", f"{_TENANT}/retention/shred"): KEYS_WRITE,
    ("POST", "/admin/v1/retention/purge"): KEYS_WRITE,
    ("GET", "/admin/v1/audit/export"): AUDIT_EXPORT,
    ("GET", f"{_TENANT}/retention/{{record_id}}"): RETENTION_READ,
    ("GET", "/metrics"): METRICS_READ,
    ("POST", "/admin/v1/admin-tokens"): TOKENS_WRITE,
    ("POST", "/admin/v1/admin-tokens/{token_id}/revoke"): TOKENS_WRITE,
    ("GET", "/admin/v1/openapi.json"): ADMIN_READ,
}


def route_scope(method: str, path_template: str) -> str | None:
    """The scope an admin route needs; ``None``: no scope grants it."""
    if method == "OPTIONS":
        return ADMIN_READ
    return ADMIN_ROUTE_SCOPES.get((method, path_template))


async def requires_tenant(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    principal: Principal | None = connection.scope.get("user")
    if principal is None or principal.kind != "tenant":
        raise Forbidden(
            "This endpoint needs a tenant API key; admin tokens cannot call it.", code="tenant_key_required"
        )


async def requires_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Admits admin tokens that hold the scope ``ADMIN_ROUTE_SCOPES`` gives the route."""
    principal: Principal | None = connection.scope.get("user")
    if principal is None or not principal.is_admin:
        raise Forbidden("This endpoint needs an admin token.", code="admin_token_required")
    scope = route_scope(connection.scope.get("method", ""), connection.scope.get("path_template", ""))
    _check_scope(principal, scope)


def requires_scope(scope: str) -> Callable[[ASGIConnection, BaseRouteHandler], Awaitable[None]]:
    """A guard that admits only admin tokens issued with ``scope`` (on top of ``requires_admin``)."""

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        _check_scope(connection.scope.get("user"), scope)

    return guard


def _check_scope(principal: Principal | None, scope: str | None) -> None:
    if scope is None:
        raise Forbidden("No admin scope grants this endpoint.", code="scope_required")
    if principal is None or not principal.has_scope(scope):
        message = f"This endpoint needs an admin token with the '{scope}' scope."
        raise Forbidden(message, code="scope_required")
