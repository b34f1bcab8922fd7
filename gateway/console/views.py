"""Rendering the console's pages: one Jinja environment (autoescaped), security headers on every answer,
and the console's errors as pages instead of the API's JSON bodies."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.response import Redirect

from gateway.errors import GatewayError
from gateway.errors import exception_handlers as api_handlers

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
# No inline script or style anywhere: scripts and styles come from /admin/static only; the charts are
# inline SVG with presentation attributes (not CSS). Nothing may frame the console.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cache-control": "no-store",
}


class NotSignedIn(Exception):
    """No valid console session: pages redirect to the sign-in form."""


@lru_cache(maxsize=1)
def _env() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(("html",), default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = lambda d: "" if d is None else d.strftime("%Y-%m-%d %H:%M:%S UTC")
    return env


def page(template: str, status_code: int = 200, headers: dict[str, str] | None = None,
         **context: Any) -> Response:
    """A rendered template as an HTML response with the console's security headers."""
    body = _env().get_template(template).render(**context)
    return Response(body, status_code=status_code, media_type="text/html; charset=utf-8",
                    headers=SECURITY_HEADERS | (headers or {}))


def see_other(path: str) -> Redirect:
    """Post/redirect/get: a 303 to ``path`` (a console path, never one taken from the request)."""
    return Redirect(path, status_code=303, headers=SECURITY_HEADERS)


def add_security_headers(response: Response) -> Response:
    """``after_request`` hook of the static files."""
    response.headers.update({k: v for k, v in SECURITY_HEADERS.items() if k != "cache-control"})
    return response


def _signed_in_context(request: Request) -> dict[str, Any]:
    console = request.state.get("console")
    csrf = request.state.get("csrf", "")
    return {"console": console, "csrf": csrf}


def on_not_signed_in(request: Request, _: NotSignedIn) -> Response:
    if request.method == "GET":
        return see_other("/admin/login")
    return page("error.html", 401, console=None, csrf="", status=401,
                message="Your session has ended. Sign in again.")


def on_gateway_error(request: Request, exc: GatewayError) -> Response:
    """A service's refusal (404, 403, 409, ...) as a page; 5xx keep the message the API would give and
    are logged as the API logs them."""
    if exc.status_code >= 500:
        api_handlers[GatewayError](request, exc)
    return page("error.html", exc.status_code, exc.headers, status=exc.status_code, message=exc.message,
                **_signed_in_context(request))


def on_http_error(request: Request, exc: HTTPException) -> Response:
    return page("error.html", exc.status_code, status=exc.status_code, message=exc.detail,
                **_signed_in_context(request))


def on_server_error(request: Request, exc: Exception) -> Response:
    """The API's handler logs it and picks the status (503 for an unavailable database or audit trail,
    else 500); the console shows that status as a page, without the exception's text."""
    handler = next(api_handlers[cls] for cls in type(exc).__mro__ if cls in api_handlers)
    answer = handler(request, exc)
    retry = answer.headers.get("retry-after")
    message = ("The database or the audit trail is unavailable; nothing was changed. Try again shortly."
               if answer.status_code == 503 else "Internal server error.")
    return page("error.html", answer.status_code, {"retry-after": retry} if retry else None,
                status=answer.status_code, message=message, **_signed_in_context(request))


EXCEPTION_HANDLERS = {NotSignedIn: on_not_signed_in, GatewayError: on_gateway_error,
                      HTTPException: on_http_error, Exception: on_server_error}
