"""Authorization guards: tenant keys only on ``/v1``, admin tokens only on ``/admin`` and ``/metrics``.

Guards are coroutine functions although they never await: Litestar runs a plain function guard in a
worker thread (``AsyncCallable``), a thread round trip on every request for a dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import Forbidden
from gateway.services.keys import Principal


async def requires_tenant(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    principal: Principal | None = connection.scope.get("user")
    if principal is None or principal.kind != "tenant":
        raise Forbidden(
            "This endpoint needs a tenant API key; admin tokens cannot call it.", code="tenant_key_required"
        )


async def requires_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    principal: Principal | None = connection.scope.get("user")
    if principal is None or not principal.is_admin:
        raise Forbidden("This endpoint needs an admin token.", code="admin_token_required")


def requires_scope(scope: str) -> Callable[[ASGIConnection, BaseRouteHandler], Awaitable[None]]:
    """A guard that admits only admin tokens issued with ``scope`` (on top of ``requires_admin``)."""

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        principal: Principal | None = connection.scope.get("user")
        if principal is None or not principal.has_scope(scope):
            raise Forbidden(
                f"This endpoint needs an admin token with the '{scope}' scope.", code="scope_required"
            )

    return guard
