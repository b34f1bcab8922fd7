"""Bearer-token authentication middleware: resolves API keys and admin tokens to a ``Principal``."""

from __future__ import annotations

import anyio
from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import Receive, Scope, Send

from audit.context import bind_request_context, clear_request_context
from gateway.audit_hook import DeferredEvent
from gateway.errors import AuthError
from gateway.limits.auth_failures import THROTTLED, AuthFailureLimits, AuthFailures
from gateway.limits.ratelimit import exceeded
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.tenancy.keys import authenticate

PUBLIC_PATHS = ["^/healthz$", "^/readyz$"]
# Route ``opt`` flag: the handler records ``auth.success`` in its own first transaction (the admission's),
# taking it from ``request.auth`` (a ``DeferredEvent``); the middleware records it if the handler did not.
DEFER_AUTH_AUDIT = "defer_auth_audit"


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


def peer_address(connection: ASGIConnection) -> str:
    """The client's address as the server saw it (behind a proxy: what the proxy headers say, when the
    server trusts them)."""
    client = connection.client
    return client.host[:64] if client is not None and client.host else "unknown"


def auth_failures(connection: ASGIConnection) -> AuthFailures:
    """The app's failure counts (made on first use: middleware instances are per route)."""
    state = connection.app.state
    failures = state.get("auth_failures")
    if failures is None:
        rt: Runtime = state.runtime
        limits = AuthFailureLimits.from_settings(rt.settings)
        failures = state["auth_failures"] = AuthFailures(rt.audit, rt.txn.run, rt.keep_finishing, limits)
    return failures


def _success_fields(principal: Principal, path: str) -> dict[str, str | None]:
    return {
        "kind": principal.kind,
        "key_id": principal.key_id,
        "tenant_id": principal.tenant_id,
        "path": path,
    }


class ApiKeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Every path except ``PUBLIC_PATHS`` needs a valid tenant key or admin token; guards decide which.

    Every result is audited: ``auth.success`` before the handler runs, or, on routes flagged
    ``DEFER_AUTH_AUDIT`` (completions), in the handler's admission transaction, which the request cannot
    pass without; if it never gets there, this middleware records the event when the request ends.
    Failures are counted per peer address (``AuthFailures``): audited in batches with their counts, and
    past the peer's limit answered with a 429 before the key is looked up.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            deferred = scope.get("auth")
            if isinstance(deferred, DeferredEvent) and not deferred.is_recorded:
                with anyio.CancelScope(shield=True):  # also when the client went away
                    await deferred.flush(scope["app"].state.runtime.audit)

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        runtime: Runtime = connection.app.state.runtime
        # The route template, not the concrete path: a path parameter may carry user content.
        path = connection.scope.get("path_template") or connection.scope["path"]
        clear_request_context()
        failures, peer = auth_failures(connection), peer_address(connection)
        retry_after = failures.retry_after(peer)
        if retry_after is not None:  # answered without touching the database
            await failures.record(peer, THROTTLED, path, may_write=False)
            raise exceeded("Too many failed authentications from this address.", retry_after, THROTTLED)
        try:
            token = _bearer(connection)
            principal = await runtime.txn.read(authenticate, runtime.hasher, token)
        except AuthError as e:
            await failures.record(peer, e.code or "invalid_api_key", path, may_write=True)
            raise
        bind_request_context(tenant_id=principal.tenant_id, key_id=principal.key_id)
        event = DeferredEvent("auth.success", _success_fields(principal, path))
        handler = connection.scope.get("route_handler")
        if runtime.audit.is_transactional and handler is not None and handler.opt.get(DEFER_AUTH_AUDIT):
            return AuthenticationResult(user=principal, auth=event)
        # Not waited to disk: logs flush in order, so the durable commit of any work this request
        # does (an admin change) makes auth.success durable first.
        await runtime.audit.emit(event.name, durable=False, **event.fields)
        return AuthenticationResult(user=principal, auth=None)
