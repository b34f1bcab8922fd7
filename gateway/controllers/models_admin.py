"""Admin API for served models: the built-in engine's, and routes to upstream pools (versioned, audited)."""

from __future__ import annotations

import asyncio
import re

from litestar import Controller, Request, delete, get, put
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.body import parse_body
from gateway.errors import InvalidRequest
from gateway.guards import requires_admin
from gateway.openapi import route_doc
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.routes import MODEL_NAME_PATTERN, ModelOut, RouteOut, RoutePut
from gateway.tenancy import routes
from gateway.tenancy.admin_audit import AdminActor
from gateway.upstream.stored import SEALING_LABEL, current_routes
from gateway.upstream.table import load_route_tokenizer

_NAME = re.compile(MODEL_NAME_PATTERN)


def _name(raw: str) -> str:
    name = raw.lstrip("/")
    if not 1 <= len(name) <= 256 or _NAME.match(name) is None:
        raise InvalidRequest("A model name is 1 to 256 letters, digits and . _ : / -.", param="name")
    return name


class ModelsAdminController(Controller):
    path = "/admin/v1/models"
    guards = [requires_admin]

    @get("/")
    async def list_models(self, session: AsyncSession, runtime: Runtime) -> list[ModelOut]:
        """Every served model: the built-in engine's first, then each route's current version."""
        rows = [routes.route_to_schema(r) for r in await current_routes(session)]
        return [ModelOut(name=runtime.engine.model_name, backend="engine")] + [
            ModelOut(name=r.name, backend="upstream", version=r.version, route=r.route,
                     has_api_key=r.has_api_key, warnings=r.warnings) for r in rows]

    @get("/{name:path}")
    async def get_route(self, session: AsyncSession, name: str) -> RouteOut:
        """A model's current route.

        Raises:
            NotFound: No route of that name (404).
        """
        return await routes.get_route(session, _name(name))

    @put("/{name:path}", opt=route_doc(request=RoutePut, errors=(409,)))
    async def put_route(
        self, request: Request, session: AsyncSession, runtime: Runtime, principal: Principal, name: str
    ) -> RouteOut:
        """Store a new version of a model's route to an upstream pool; its tokenizer must load here. The
        previous version's API key is kept only while the URLs stay the same; the reply's ``warnings``
        name the route's cross-tenant leakage channels.

        Raises:
            InvalidRequest: A bad route, a tokenizer that does not load, a private or metadata address
                (400 ``upstream_address_refused``), or servers that cannot keep their cache per tenant
                without ``shared_cache`` (400 ``route_not_isolated``).
            Conflict: ``expected_version`` is stale (409).
        """
        name, body = _name(name), parse_body(await request.body(), RoutePut)
        try:
            await asyncio.to_thread(load_route_tokenizer, body.route.tokenizer)
        except ValueError as e:
            raise InvalidRequest(str(e), code="tokenizer_unavailable", param="route.tokenizer") from None
        by = AdminActor(runtime.audit, principal.key_id)
        out = await routes.put_route(session, by, runtime.hasher.derive(SEALING_LABEL), name, body,
                                     runtime.engine.model_name,
                                     allow_private=runtime.settings.upstream_allow_private_addresses)
        await runtime.routes.refresh()  # this replica at once; the others within their refresh period
        return out

    @delete("/{name:path}", status_code=200)
    async def delete_route(
        self, session: AsyncSession, runtime: Runtime, principal: Principal, name: str
    ) -> RouteOut:
        """Stop serving a model's route (a version that deletes it; the history stays)."""
        out = await routes.delete_route(session, AdminActor(runtime.audit, principal.key_id), _name(name))
        await runtime.routes.refresh()
        return out


@get("/admin/v1/model-history/{name:path}", guards=[requires_admin])
async def model_route_history(session: AsyncSession, name: str) -> list[RouteOut]:
    """Every version of a model's route, oldest first, with who changed it (never its API key)."""
    return await routes.route_history(session, _name(name))
