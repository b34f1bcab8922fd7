"""The console's one guard: a live session, the route's scope, and on every change the CSRF token."""

from __future__ import annotations

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.console.session import COOKIE, ConsoleSession, SessionSigner, still_valid
from gateway.console.views import NotSignedIn
from gateway.errors import Forbidden
from gateway.runtime import Runtime

# Route ``opt`` keys: the scope a console route needs (the same scopes as the API's routes), and the
# routes anyone may reach (the sign-in form, the static files). A route with neither is refused.
CONSOLE_SCOPE = "console_scope"
CONSOLE_PUBLIC = "console_public"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
_SAFE_METHODS = frozenset({"GET", "HEAD"})


def signer(connection: ASGIConnection) -> SessionSigner:
    """The app's session signer (made on first use, from the runtime's pepper)."""
    state = connection.app.state
    found = state.get("console_signer")
    if found is None:
        runtime: Runtime = state.runtime
        found = state["console_signer"] = SessionSigner(runtime.hasher)
    return found


async def _session(connection: ASGIConnection) -> ConsoleSession:
    session = signer(connection).parse(connection.cookies.get(COOKIE))
    if session is None:
        raise NotSignedIn()
    runtime: Runtime = connection.app.state.runtime
    live = await runtime.txn.read(still_valid, session)
    if live is None:
        raise NotSignedIn()
    return live


async def _check_csrf(connection: ASGIConnection, expected: str) -> None:
    given = connection.headers.get(CSRF_HEADER)
    if given is None and isinstance(connection, Request):
        form = await connection.form()  # parsed once; the handler reads the same parsed form
        value = form.get(CSRF_FIELD)
        given = value if isinstance(value, str) else None
    if not SessionSigner.is_same(expected, given):
        raise Forbidden("The form's CSRF token is missing or wrong; reload the page and try again.",
                        code="csrf_failed")


async def requires_console(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Admits a request with a live console session whose admin token has the route's scope; a change
    (any method but GET/HEAD) must also carry the session's CSRF token (form field or header).

    Raises:
        NotSignedIn: No session, a bad or expired cookie, or its admin token revoked or expired.
        Forbidden: The token lacks the route's scope, or the CSRF token is wrong (403).
    """
    if handler.opt.get(CONSOLE_PUBLIC):
        return
    session = await _session(connection)
    csrf = signer(connection).csrf(session)
    connection.state.console, connection.state.csrf = session, csrf
    if connection.scope.get("method") not in _SAFE_METHODS:
        await _check_csrf(connection, csrf)
    scope = handler.opt.get(CONSOLE_SCOPE)
    if scope is None:
        raise Forbidden("No admin scope grants this page.", code="scope_required")
    if not session.can(scope):
        raise Forbidden(f"This needs an admin token with the '{scope}' scope.", code="scope_required")


def provide_console(request: Request) -> ConsoleSession:
    return request.state.console
