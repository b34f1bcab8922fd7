"""Signing in to the console with an admin token, and signing out."""

from __future__ import annotations

import secrets
import time

from litestar import Controller, Request, Response, get, post
from litestar.datastructures import Cookie

from gateway.auth import auth_failures, peer_address
from gateway.console.guard import CONSOLE_PUBLIC, CONSOLE_SCOPE, CSRF_FIELD, signer
from gateway.console.session import COOKIE, LOGIN_COOKIE, ConsoleSession, sign_out
from gateway.console.views import page, see_other
from gateway.errors import AuthError
from gateway.runtime import Runtime
from gateway.schemas.admin import ADMIN_READ
from gateway.tenancy.keys import authenticate

_PATH = "/admin/login"
_MAX_TOKEN_CHARS = 256


def _cookie(key: str, value: str, max_age: int) -> Cookie:
    return Cookie(key=key, value=value, max_age=max_age, path="/", secure=True, httponly=True,
                  samesite="strict")


def _form(request: Request, message: str | None, status_code: int = 200) -> Response:
    """The sign-in form, with a fresh CSRF token bound to a cookie of its own."""
    nonce = secrets.token_urlsafe(24)
    response = page("login.html", status_code, console=None, csrf=signer(request).login_csrf(nonce),
                    message=message)
    response.set_cookie(_cookie(LOGIN_COOKIE, nonce, 600))
    return response


class SignInController(Controller):
    path = "/"

    @get("/", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def home(self) -> Response:
        """The console's first page."""
        return see_other("/admin/tenants")

    @get("/login", opt={CONSOLE_PUBLIC: True})
    async def login_form(self, request: Request) -> Response:
        """The sign-in form."""
        return _form(request, None)

    @post("/login", opt={CONSOLE_PUBLIC: True})
    async def login(self, request: Request, runtime: Runtime) -> Response:
        """Exchange an admin token for a session cookie; the token itself is never stored in the browser.

        Failures count toward the peer's authentication-failure limit, as on the API.
        """
        form = await request.form()
        nonce = request.cookies.get(LOGIN_COOKIE, "")
        if not nonce or not signer(request).is_same(signer(request).login_csrf(nonce), form.get(CSRF_FIELD)):
            return _form(request, "The sign-in form expired; try again.", 403)
        failures, peer = auth_failures(request), peer_address(request)
        if failures.retry_after(peer) is not None:
            return _form(request, "Too many failed sign-ins from this address; wait a minute.", 429)
        token = str(form.get("token", "")).strip()[:_MAX_TOKEN_CHARS]
        try:
            principal = await runtime.txn.read(authenticate, runtime.hasher, token)
            if not principal.is_admin:
                raise AuthError("A tenant API key cannot sign in.", code="admin_token_required")
        except AuthError as e:
            await failures.record(peer, e.code or "invalid_api_key", _PATH, may_write=True)
            return _form(request, "That is not a valid admin token.", 401)
        if not principal.has_scope(ADMIN_READ):
            return _form(request, f"This admin token lacks the '{ADMIN_READ}' scope the console needs.", 403)
        session, cookie = signer(request).issue(principal)
        await runtime.audit.emit("auth.success", kind="admin", key_id=principal.key_id, tenant_id=None,
                                 path=_PATH, scopes=sorted(principal.scopes))
        response = see_other("/admin/tenants")
        response.set_cookie(_cookie(COOKIE, cookie, session.expires_at - int(time.time())))
        response.set_cookie(_cookie(LOGIN_COOKIE, "", 0))
        return response

    @post("/logout", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def logout(self, request: Request, runtime: Runtime, console: ConsoleSession) -> Response:
        """End this session (its cookie is refused from now on, even if kept, on every replica) and clear
        the cookie."""
        await runtime.txn.run(sign_out, console)
        await runtime.audit.emit("admin.console_signed_out", required=False, actor=console.token_id,
                                 target_type="console_session", target_id=console.sid[:12])
        response = see_other(_PATH)
        response.set_cookie(_cookie(COOKIE, "", 0))
        return response
