"""Signed audit exports over HTTP: validate the query, build the bundle, then stream it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

from litestar.response import Stream
from sqlalchemy.ext.asyncio import AsyncSession

from audit import bundle
from audit.export import ExportSpec, stream_bundle_tar
from audit.store import AuditUnavailable, format_ts
from gateway.audit_hook import AuditUnavailableError
from gateway.errors import InvalidRequest, ServiceUnavailable
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.storage.models import Tenant


def _when(value: str | None, param: str) -> datetime | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"{param} must be an ISO-8601 date or date-time.", param=param) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


async def parse_export_query(
    session: AsyncSession, since: str | None, until: str | None, tenant: str | None, fmt: str
) -> ExportSpec:
    """Validate the query parameters of ``GET /admin/v1/audit/export``.

    Raises:
        InvalidRequest: A bad date, ``until`` before ``since``, an unknown format or tenant (400).
    """
    start, end = _when(since, "since"), _when(until, "until")
    if start is not None and end is not None and end < start:
        raise InvalidRequest("until must not be before since.", param="until")
    if fmt not in bundle.EVENT_FILES:
        raise InvalidRequest(
            f"format must be one of {', '.join(sorted(bundle.EVENT_FILES))}.", param="format"
        )
    if tenant is not None and await session.get(Tenant, tenant) is None:
        raise InvalidRequest("No such tenant.", code="tenant_not_found", param="tenant")
    return ExportSpec(since=start, until=end, tenant=tenant, fmt=fmt)


async def _resume(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


def _filename(spec: ExportSpec) -> str:
    parts = ["kvgate-audit", spec.tenant or "all", spec.fmt]
    if spec.until is not None:
        parts.append("until-" + format_ts(spec.until)[:19].replace(":", ""))
    return "-".join(parts) + ".tar"


async def export_response(rt: Runtime, principal: Principal, spec: ExportSpec) -> Stream:
    """Build the signed bundle (recording the export in the trail), then stream it as one ``.tar``.

    The first chunk is awaited before the response starts, so an unavailable store is a clean 503
    rather than a stream that breaks half way.

    Raises:
        ServiceUnavailable: The gateway does not chain audit events into a store (503).
        AuditUnavailableError: The store could not be read or the export not recorded (503).
    """
    if rt.audit_store is None:
        raise ServiceUnavailable("The audit trail is not enabled on this gateway.", code="audit_disabled")
    chunks = stream_bundle_tar(rt.audit_store, spec, actor=principal.key_id)
    try:
        first = await anext(chunks)
    except AuditUnavailable as e:
        raise AuditUnavailableError("audit.exported") from e
    return Stream(
        _resume(first, chunks),
        media_type="application/x-tar",
        headers={"content-disposition": f'attachment; filename="{_filename(spec)}"'},
    )
