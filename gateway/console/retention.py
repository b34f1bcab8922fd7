"""Console pages for a tenant's retained prompts: the list (metadata only) and reading one record, which
needs ``retention:read`` and a stated reason and is audited before anything is decrypted, as on the API."""

from __future__ import annotations

import orjson
from litestar import Controller, Request, Response, get, post
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.forms import text_fields
from gateway.console.guard import CONSOLE_SCOPE
from gateway.console.session import ConsoleSession
from gateway.console.views import page
from gateway.errors import ClientError
from gateway.inference import retention
from gateway.runtime import Runtime
from gateway.schemas.admin import ADMIN_READ, RETENTION_READ
from gateway.schemas.audit import RetainedRecordOut
from gateway.tenancy import tenants

_LISTED = 100


async def _records_page(request: Request, session: AsyncSession, runtime: Runtime, tenant_id: str,
                        status: int = 200, errors: list[tuple[str, str]] | None = None,
                        record: RetainedRecordOut | None = None) -> Response:
    console: ConsoleSession = request.state.console
    shown = None if record is None else {
        "prompt": orjson.dumps(record.prompt, option=orjson.OPT_INDENT_2).decode(),
        "completion": orjson.dumps(record.completion, option=orjson.OPT_INDENT_2).decode()}
    return page("retention.html", status, console=console, csrf=request.state.csrf,
                tenant=await tenants.get_tenant(session, tenant_id),
                records=await retention.list_records(runtime, session, tenant_id, _LISTED),
                errors=errors or [], record=record, shown=shown, can_read=console.can(RETENTION_READ))


class RetentionController(Controller):
    path = "/tenants/{tenant_id:str}/retention"

    @get("/", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def records(self, request: Request, session: AsyncSession, runtime: Runtime,
                      tenant_id: str) -> Response:
        """The tenant's newest retained records (nothing decrypted)."""
        return await _records_page(request, session, runtime, tenant_id)

    @post("/{record_id:str}", opt={CONSOLE_SCOPE: RETENTION_READ})
    async def read(self, request: Request, session: AsyncSession, runtime: Runtime, console: ConsoleSession,
                   tenant_id: str, record_id: str) -> Response:
        """Decrypt one record: the read and its reason are recorded in the audit trail first."""
        reason = (await text_fields(request, "reason"))["reason"]
        try:
            record = await retention.read_record(runtime, console.principal, tenant_id, record_id, reason)
        except ClientError as e:
            return await _records_page(request, session, runtime, tenant_id, e.status_code,
                                       [(e.param or "", e.message)])
        return await _records_page(request, session, runtime, tenant_id, record=record)
