"""Console pages for the audit trail: a signed export for a time range and tenant, its verification
result against the server's pinned key, and its download."""

from __future__ import annotations

from datetime import UTC, datetime

from litestar import Controller, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.response import File
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.exports import ExportFiles
from gateway.console.forms import text_fields
from gateway.console.guard import CONSOLE_SCOPE
from gateway.console.session import ConsoleSession
from gateway.console.views import SECURITY_HEADERS, page
from gateway.errors import ClientError
from gateway.runtime import Runtime
from gateway.schemas.admin import AUDIT_EXPORT
from gateway.tenancy import audit_export, tenants


def exports_of(connection: ASGIConnection) -> ExportFiles:
    state = connection.app.state
    found = state.get("console_exports")
    if found is None:
        runtime: Runtime = state.runtime
        found = state["console_exports"] = ExportFiles(runtime.settings.data_dir / "console-exports")
    return found


async def _audit_page(request: Request, session: AsyncSession, status: int = 200,
                      **context: object) -> Response:
    console: ConsoleSession = request.state.console
    blank = {"since": "", "until": "", "tenant": "", "format": "jsonl"}
    defaults = {"errors": [], "export": None, "form": blank}
    return page("audit.html", status, console=console, csrf=request.state.csrf,
                tenants=await tenants.list_tenants(session),
                recent=exports_of(request).recent(console.token_id),
                **(defaults | context))


class AuditController(Controller):
    path = "/audit"

    @get("/", opt={CONSOLE_SCOPE: AUDIT_EXPORT})
    async def audit(self, request: Request, session: AsyncSession) -> Response:
        """The export form and this token's recent exports."""
        return await _audit_page(request, session)

    @post("/exports", opt={CONSOLE_SCOPE: AUDIT_EXPORT})
    async def export(self, request: Request, session: AsyncSession, runtime: Runtime,
                     console: ConsoleSession) -> Response:
        """Make a signed export (recorded in the trail, as on the API) and verify it with the pinned key."""
        form = await text_fields(request, "since", "until", "tenant", "format")
        try:
            spec = await audit_export.parse_export_query(
                session, form["since"].strip() or None, form["until"].strip() or None,
                form["tenant"].strip() or None, form["format"].strip() or "jsonl")
        except ClientError as e:
            return await _audit_page(request, session, e.status_code, errors=[(e.param or "", e.message)],
                                     form=form)
        made = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        filename = f"kvgate-audit-{spec.tenant or 'all'}-{spec.fmt}-{made}.tar"
        export = await exports_of(request).create(runtime, console.token_id, spec, filename)
        return await _audit_page(request, session, 201, export=export, form=form)

    @get("/exports/{export_id:str}", opt={CONSOLE_SCOPE: AUDIT_EXPORT})
    async def download(self, request: Request, console: ConsoleSession, export_id: str) -> File:
        """Download an export this admin token made (kept for 15 minutes)."""
        export = exports_of(request).get(export_id, console.token_id)
        return File(export.path, filename=export.filename, media_type="application/x-tar",
                    headers=SECURITY_HEADERS)
