"""Model routes to upstream pools: versioned, each change committed with its audit event; upstream API
keys sealed at rest and never returned."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.clock import as_utc, utcnow
from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.schemas.routes import NON_ISOLATING_KINDS, RouteOut, RoutePut, UpstreamRoute
from gateway.storage.models import ModelRoute
from gateway.tenancy.admin_audit import AdminActor
from gateway.upstream.addresses import refused_urls
from gateway.upstream.stored import parse_route, seal_api_key

ROUTE_CHANGED = "admin.model_route_changed"
ROUTE_DELETED = "admin.model_route_deleted"
def route_to_schema(row: ModelRoute) -> RouteOut:
    route = None if row.is_deleted else parse_route(row.body)
    return RouteOut(
        name=row.name,
        version=row.version,
        route=route,
        has_api_key=row.api_key_sealed is not None,
        changed_by=row.changed_by,
        comment=row.comment,
        created_at=as_utc(row.created_at),
        warnings=() if route is None else route.warnings,
    )


async def _latest(session: AsyncSession, name: str) -> ModelRoute | None:
    stmt = select(ModelRoute).where(ModelRoute.name == name).order_by(ModelRoute.version.desc()).limit(1)
    return (await session.scalars(stmt)).first()


async def get_route(session: AsyncSession, name: str) -> RouteOut:
    row = await _latest(session, name)
    if row is None or row.is_deleted:
        raise NotFound("No such model route.", code="model_not_found")
    return route_to_schema(row)


async def route_history(session: AsyncSession, name: str) -> list[RouteOut]:
    rows = list(await session.scalars(
        select(ModelRoute).where(ModelRoute.name == name).order_by(ModelRoute.version)))
    if not rows:
        raise NotFound("No such model route.", code="model_not_found")
    return [route_to_schema(r) for r in rows]


def _check_version(latest: ModelRoute | None, expected: int | None) -> int:
    version = 0 if latest is None else latest.version
    if expected is not None and expected != version:
        raise Conflict(f"The route is at version {version}, not {expected}.", code="version_conflict")
    return version


async def _append(session: AsyncSession, by: AdminActor, row: ModelRoute, event: str) -> None:
    session.add(row)
    try:
        after = None if row.is_deleted else parse_route(row.body).model_dump(mode="json")
        await by.commit(session, event, target_type="model_route", target_id=row.name, version=row.version,
                        after=after, comment=row.comment)
    except IntegrityError as e:
        await session.rollback()
        raise Conflict("The route was changed concurrently; retry.", code="version_conflict") from e


def check_route(route: UpstreamRoute, *, allow_private: bool) -> None:
    """What a route may not be: one to a private or metadata address (unless ``allow_private``), or to
    servers that cannot keep their prefix cache per tenant without the operator saying it is shared.

    Raises:
        InvalidRequest: 400 ``upstream_address_refused`` or ``route_not_isolated``.
    """
    refused = [] if allow_private else refused_urls(route.urls)
    if refused:
        raise InvalidRequest(
            f"{refused[0]!r} is a private, loopback, link-local or metadata address; upstreams must be "
            "public unless the server allows private ones (upstream_allow_private_addresses).",
            code="upstream_address_refused", param="route.urls")
    if route.kind in NON_ISOLATING_KINDS and not route.shared_cache:
        raise InvalidRequest(
            f"{route.kind} servers cannot keep their prefix cache per tenant: the tenants routed there would "
            "share it, a cross-tenant leakage channel. Set shared_cache to true to accept that (only tenants "
            "whose policy has allow_shared_upstream_cache are then routed there).",
            code="route_not_isolated", param="route.shared_cache")


def _kept_key(latest: ModelRoute | None, body: RoutePut) -> str | None:
    """The previous version's sealed key, if this version keeps it: not once cleared, deleted, or sent
    to other URLs (a key given for one server is never sent to another without being given again)."""
    if latest is None or latest.is_deleted or body.clear_api_key:
        return None
    if set(parse_route(latest.body).urls) != set(body.route.urls):
        return None
    return latest.api_key_sealed


async def put_route(
    session: AsyncSession, by: AdminActor, sealing_key: bytes, name: str, body: RoutePut, engine_model: str,
    *, allow_private: bool = False,
) -> RouteOut:
    """Append a version of ``name``'s route (its first creates it); ``allow_private``: the route may
    point at private addresses.

    Raises:
        InvalidRequest: ``name`` is the built-in engine's model (400 ``model_reserved``), or the route is
            one ``check_route`` refuses.
        Conflict: ``expected_version`` is stale, or another writer won the race (409).
    """
    if name == engine_model:
        raise InvalidRequest("The built-in engine's model cannot be routed upstream.", code="model_reserved",
                             param="name")
    check_route(body.route, allow_private=allow_private)
    latest = await _latest(session, name)
    version = _check_version(latest, body.expected_version)
    sealed = _kept_key(latest, body)
    if body.api_key is not None:
        sealed = seal_api_key(sealing_key, name, body.api_key.get_secret_value())
    row = ModelRoute(name=name, version=version + 1, body=body.route.model_dump_json(), api_key_sealed=sealed,
                     is_deleted=False, changed_by=by.id, comment=body.comment, created_at=utcnow())
    await _append(session, by, row, ROUTE_CHANGED)
    return route_to_schema(row)


async def delete_route(session: AsyncSession, by: AdminActor, name: str, comment: str = "") -> RouteOut:
    """Stop serving ``name``: a version that deletes it (the history stays).

    Raises:
        NotFound: No such route, or it is deleted already (404).
    """
    latest = await _latest(session, name)
    if latest is None or latest.is_deleted:
        raise NotFound("No such model route.", code="model_not_found")
    row = ModelRoute(name=name, version=latest.version + 1, body=latest.body, api_key_sealed=None,
                     is_deleted=True, changed_by=by.id, comment=comment, created_at=utcnow())
    await _append(session, by, row, ROUTE_DELETED)
    return route_to_schema(row)
