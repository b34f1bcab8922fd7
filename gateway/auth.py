"""Bearer-token authentication middleware: resolves API keys and admin tokens to a ``Principal``."""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from sqlalchemy import Connection

from audit.context import bind_request_context, clear_request_context
from gateway.errors import AuthError
from gateway.runtime import Runtime
from gateway.services.keys import Principal, authenticate

PUBLIC_PATHS = ["^/healthz$", "^/readyz$"]


def _bearer(connection: ASGIConnection) -> str:
    header = connection.headers.get("authorization")
    if not header:
        raise AuthError(
            "You didn't provide an API key. Use 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("Malformed Authorization header; expected 'Bearer <key>'.", code="malformed_api_key")
    return token


def _success_fields(principal: Principal, path: str) -> dict[str, str | None]:
    return {
        "kind": principal.kind,
        "key_id": principal.key_id,
        "tenant_id": principal.tenant_id,
        "path": path,
    }


def _authenticate(conn: Connection, runtime: Runtime, token: str, path: str) -> tuple[Principal, bool]:
    """Look the token up and, when the audit sink can join, record ``auth.success`` in the same
    transaction. Returns the principal and whether the event is already recorded."""
    principal = authenticate(conn, runtime.hasher, token)
    step = runtime.audit.step("auth.success", **_success_fields(principal, path))
    if step is not None:
        step(conn)
    return principal, step is not None


class ApiKeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Every path except ``PUBLIC_PATHS`` needs a valid tenant key or admin token; guards decide which."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        runtime: Runtime = connection.app.state.runtime
        # The route template, not the concrete path: a path parameter may carry user content.
        path = connection.scope.get("path_template") or connection.scope["path"]
        clear_request_context()
        try:
            token = _bearer(connection)
            # Not waited to disk: logs flush in order, so the durable commit of any work this request
            # does (the admission, an admin change) makes auth.success durable first.
            principal, is_audited = await runtime.txn.run(
                _authenticate, runtime, token, path, durable=False
            )
        except AuthError as e:
            await runtime.audit.emit("auth.failure", required=False, reason=e.code, path=path)
            raise
        bind_request_context(tenant_id=principal.tenant_id, key_id=principal.key_id)
        if not is_audited:
            await runtime.audit.emit("auth.success", **_success_fields(principal, path))
        return AuthenticationResult(user=principal, auth=None)
