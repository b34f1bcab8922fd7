"""Bearer-token authentication middleware: resolves API keys and admin tokens to a ``Principal``."""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult

from gateway.errors import AuthError
from gateway.runtime import Runtime
from gateway.services.keys import authenticate

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


class ApiKeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Every path except ``PUBLIC_PATHS`` needs a valid tenant key or admin token; guards decide which."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        runtime: Runtime = connection.app.state.runtime
        path = connection.scope["path"]
        try:
            token = _bearer(connection)
            async with runtime.sessionmaker() as session:
                principal = await authenticate(session, runtime.hasher, token)
        except AuthError as e:
            await runtime.audit.emit("auth.failure", required=False, reason=e.code, path=path)
            raise
        await runtime.audit.emit(
            "auth.success",
            kind=principal.kind,
            key_id=principal.key_id,
            tenant_id=principal.tenant_id,
            path=path,
        )
        return AuthenticationResult(user=principal, auth=None)
