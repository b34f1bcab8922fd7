"""The composition root: ``create_app(settings)`` builds the Litestar app, its DI and its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar
from litestar.config.app import AppConfig
from litestar.datastructures import State
from litestar.di import Provide
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.plugins import InitPluginProtocol

from gateway.audit_hook import AuditHook, AuditSink
from gateway.auth import PUBLIC_PATHS, ApiKeyAuthMiddleware
from gateway.console import console_router
from gateway.controllers.admin import AdminController
from gateway.controllers.audit import AuditController
from gateway.controllers.health import healthz, metrics, readyz
from gateway.controllers.models_admin import ModelsAdminController, model_route_history
from gateway.controllers.openai import OpenAIController
from gateway.controllers.tokens import TokenizeController
from gateway.deps import provide_principal, provide_runtime, provide_session
from gateway.errors import exception_handlers
from gateway.openapi import admin_openapi, complete_openapi
from gateway.runtime import Runtime
from gateway.settings import Settings, get_settings


class GatewayPlugin(InitPluginProtocol):
    """Wires routes, DI, auth, errors and the lifespan onto the app config in small steps."""

    def __init__(self, runtime: Runtime, *, has_custom_sink: bool = False) -> None:
        self.runtime = runtime
        self.has_custom_sink = has_custom_sink

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        self._configure_routes(app_config)
        self._configure_dependencies(app_config)
        self._configure_security(app_config)
        self._configure_lifespan(app_config)
        app_config.exception_handlers.update(exception_handlers)
        app_config.openapi_config = OpenAPIConfig(
            title="kvgate", version="0.1.0", use_handler_docstrings=True
        )
        # Litestar builds the document from what it sees; this adds what it does not (gateway/openapi.py).
        app_config.on_startup.append(complete_openapi)
        return app_config

    def _configure_routes(self, cfg: AppConfig) -> None:
        cfg.route_handlers.extend(
            [OpenAIController, TokenizeController, AdminController, ModelsAdminController, AuditController,
             healthz, readyz, metrics, model_route_history, admin_openapi, console_router()]
        )

    def _configure_dependencies(self, cfg: AppConfig) -> None:
        cfg.state = State({"runtime": self.runtime})
        cfg.dependencies.update(
            {
                "runtime": Provide(provide_runtime, sync_to_thread=False),
                "session": Provide(provide_session),
                "principal": Provide(provide_principal, sync_to_thread=False),
            }
        )

    def _configure_security(self, cfg: AppConfig) -> None:
        # Every method needs a key, OPTIONS too (Litestar lets it through by default, for CORS
        # preflights, which this API does not serve: the guards then refused it as keyless, a 403).
        cfg.middleware.append(DefineMiddleware(ApiKeyAuthMiddleware, exclude=[*PUBLIC_PATHS, "^/schema"],
                                               exclude_http_methods=()))

    def _configure_lifespan(self, cfg: AppConfig) -> None:
        runtime, has_custom_sink = self.runtime, self.has_custom_sink

        @asynccontextmanager
        async def lifespan(_: Litestar) -> AsyncIterator[None]:
            await runtime.start(has_custom_sink=has_custom_sink)
            try:
                yield
            finally:
                await runtime.stop()

        cfg.lifespan.append(lifespan)


def create_app(
    settings: Settings | None = None,
    *,
    engine: Any = None,
    audit_sink: AuditSink | None = None,
    debug: bool = False,
) -> Litestar:
    """Build the gateway app.

    Args:
        settings: Configuration; ``None`` reads ``get_settings()``.
        engine: An already-started ``AsyncLLMEngine`` to share (tests); ``None`` loads one at start-up.
        audit_sink: Where audit events go; ``None`` chains them into ``audit.AuditStore`` on the same
            database (or logs them when ``settings.audit_enabled`` is off).
        debug: Litestar debug mode.

    Returns:
        The Litestar app; the database must already be migrated (``kvgate db upgrade``).
    """
    runtime = Runtime(settings or get_settings(), AuditHook(audit_sink), engine=engine)
    # NOTE: passed to the constructor because Litestar ignores request_max_body_size set by plugins.
    # logging_config=None: Litestar's default would dictConfig the root logger with a plain-text
    # handler, bypassing the one redacting chain that audit.logging.configure_logging installs.
    return Litestar(
        plugins=[GatewayPlugin(runtime, has_custom_sink=audit_sink is not None)],
        debug=debug,
        request_max_body_size=runtime.settings.max_body_bytes,
        logging_config=None,
    )
