"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from litestar import Response, get

from gateway.guards import requires_admin
from gateway.openapi import Body, Reply, route_doc
from gateway.runtime import Runtime
from gateway.schemas.responses import Health, Readiness

_READINESS = Body(Readiness)


@get(
    "/healthz",
    exclude_from_auth=True,
    sync_to_thread=False,
    opt=route_doc(responses={200: Reply("Alive.", (Body(Health),))}),
)
def healthz() -> dict[str, str]:
    """Liveness: the process answers.

    Returns:
        ``{"status": "ok"}``.
    """
    return {"status": "ok"}


@get(
    "/readyz",
    exclude_from_auth=True,
    opt=route_doc(responses={200: Reply("Ready.", (_READINESS,)), 503: Reply("Not ready.", (_READINESS,))}),
)
async def readyz(runtime: Runtime) -> Response[dict]:
    """Readiness: the engine is serving (loaded, its process alive) and the database answers.

    Returns:
        200 with both checks true, else 503.
    """
    engine = runtime.engine
    checks = {"model": engine is not None and engine.is_running, "database": await runtime.is_db_ready()}
    return Response(
        {"status": "ok" if all(checks.values()) else "unavailable", "checks": checks},
        status_code=200 if all(checks.values()) else 503,
    )


@get(
    "/metrics",
    guards=[requires_admin],
    sync_to_thread=False,
    opt=route_doc(responses={200: Reply("Prometheus text format 0.0.4.", (Body(str, "text/plain"),))}),
)
def metrics(runtime: Runtime) -> Response[bytes]:
    """Prometheus exposition (admin token required).

    Returns:
        The text format, version 0.0.4.
    """
    return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
