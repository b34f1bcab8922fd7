"""Authorization guards: tenant keys only on ``/v1``, admin tokens only on ``/admin`` and ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import Forbidden
from gateway.services.keys import Principal


def requires_tenant(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    principal: Principal | None = connection.scope.get("user")
    if principal is None or principal.kind != "tenant":
        raise Forbidden(
            "This endpoint needs a tenant API key; admin tokens cannot call it.", code="tenant_key_required"
        )


def requires_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    principal: Principal | None = connection.scope.get("user")
    if principal is None or not principal.is_admin:
        raise Forbidden("This endpoint needs an admin token.", code="admin_token_required")


def requires_scope(scope: str) -> Callable[[ASGIConnection, BaseRouteHandler], None]:
    """A guard that admits only admin tokens issued with ``scope`` (on top of ``requires_admin``)."""

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        principal: Principal | None = connection.scope.get("user")
        if principal is None or not principal.has_scope(scope):
            raise Forbidden(
                f"This endpoint needs an admin token with the '{scope}' scope.", code="scope_required"
            )

    return guard
