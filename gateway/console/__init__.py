"""The admin console: server-rendered pages at ``/admin`` over the admin API's services (docs/console.md)."""

from __future__ import annotations

from litestar import Router
from litestar.di import Provide
from litestar.static_files import create_static_files_router

from gateway.console.audit import AuditController
from gateway.console.guard import CONSOLE_PUBLIC, provide_console, requires_console
from gateway.console.policies import PoliciesController
from gateway.console.retention import RetentionController
from gateway.console.signin import SignInController
from gateway.console.tenants import TenantsController
from gateway.console.usage import UsageController
from gateway.console.views import EXCEPTION_HANDLERS, STATIC_DIR, add_security_headers

# Bearer-token authentication (gateway.auth) skips the console: its guard reads the session cookie.
_NO_BEARER = {"exclude_from_auth": True}


def console_router() -> Router:
    """Every console route under ``/admin`` (``/admin/v1`` stays the API's), out of the OpenAPI document."""
    static = create_static_files_router("/static", [STATIC_DIR], after_request=add_security_headers,
                                        opt={CONSOLE_PUBLIC: True}, include_in_schema=False)
    return Router(
        "/admin",
        route_handlers=[SignInController, TenantsController, PoliciesController, UsageController,
                        RetentionController, AuditController, static],
        guards=[requires_console],
        dependencies={"console": Provide(provide_console, sync_to_thread=False)},
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        include_in_schema=False,
        opt=_NO_BEARER,
    )
