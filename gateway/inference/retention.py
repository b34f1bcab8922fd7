"""Optional prompt retention: store a tenant's prompts and completions encrypted, read them under scope.

Off unless the tenant's policy sets ``prompt_retention_days``. Records are sealed with the tenant's
data key (``audit.retention``); reading one needs an admin token with the ``retention:read`` scope and
a stated reason, both recorded in the audit trail before anything is decrypted. Shredding the tenant's
data key makes every record unreadable at once, including copies in backups.
"""

from __future__ import annotations

from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from audit.retention import RecordInfo, RecordUnreadable
from gateway.clock import as_utc
from gateway.errors import InvalidRequest, NotFound
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.audit import PurgeOut, RetainedInfo, RetainedRecordOut, ShredOut
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.tenancy.tenants import get_tenant_row

log = structlog.get_logger()

MAX_LIST = 1000


def prompt_texts(req: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """Every piece of user text in the request (what the redactor must never let through)."""
    if isinstance(req, ChatCompletionRequest):
        calls = [c.function.arguments for m in req.messages for c in m.tool_calls or []]
        calls += [m.function_call.arguments for m in req.messages if m.function_call is not None]
        return [m.text() for m in req.messages] + calls
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    return [p for p in prompt if isinstance(p, str)]


def retained_prompt(req: ChatCompletionRequest | CompletionRequest) -> Any:
    """What retention stores as the prompt: the chat messages, or the text prompt (or token ids)."""
    if isinstance(req, ChatCompletionRequest):
        return [{"role": m.role, "content": m.text()} for m in req.messages]
    return req.prompt


async def retain(
    rt: Runtime, tenant_id: str, request_id: str, prompt: Any, completions: list[Any], days: int,
    record_id: str | None = None,
) -> str | None:
    """Seal one request's prompt and completions (as record ``record_id``, else a new id); a failure is
    logged (never its content), not raised.

    The response is already produced when this runs, so refusing it would only lose the user's work.
    """
    try:
        return await rt.retention.put(tenant_id, prompt, completions, retain_days=days, request_id=request_id,
                                      record_id=record_id)
    except Exception as e:  # noqa: BLE001
        log.error("retention.write_failed", request_id=request_id, error_type=type(e).__name__)
        return None


def _info(r: RecordInfo) -> dict[str, Any]:
    return {
        "id": r.id,
        "tenant_id": r.tenant_id,
        "request_id": r.request_id,
        "created_at": as_utc(r.created_at),
        "expires_at": as_utc(r.expires_at),
    }


async def list_records(rt: Runtime, session: AsyncSession, tenant_id: str, limit: int) -> list[RetainedInfo]:
    """The tenant's newest retained records, metadata only."""
    if not 1 <= limit <= MAX_LIST:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIST}.", param="limit")
    await get_tenant_row(session, tenant_id)
    return [RetainedInfo(**_info(r)) for r in await rt.retention.list_records(tenant_id, limit=limit)]


async def read_record(
    rt: Runtime, principal: Principal, tenant_id: str, record_id: str, reason: str | None
) -> RetainedRecordOut:
    """Decrypt one record after auditing the read (who, which record, why); fails closed (503).

    Raises:
        InvalidRequest: No ``reason`` (4 to 256 characters).
        NotFound: Unknown, expired or shredded record.
        AuditUnavailableError: The read could not be audited; nothing was decrypted.
    """
    reason = (reason or "").strip()
    if not 4 <= len(reason) <= 256:
        raise InvalidRequest("State why you read this record: reason, 4 to 256 characters.", param="reason")
    await rt.audit.emit(
        "retention.record_read",
        actor=principal.key_id,
        tenant_id=tenant_id,
        record_id=record_id,
        reason=reason,
    )
    try:
        record = await rt.retention.get(tenant_id, record_id)
    except RecordUnreadable as e:
        raise NotFound(f"Record unreadable: {e}", code="record_unreadable") from None
    info = RecordInfo(record.id, record.tenant_id, record.request_id, record.created_at, record.expires_at)
    return RetainedRecordOut(**_info(info), prompt=record.prompt, completion=record.completion)


async def shred(rt: Runtime, session: AsyncSession, principal: Principal, tenant_id: str) -> ShredOut:
    """Crypto-shred: delete the tenant's data key (and its records). Audited first, failing closed."""
    await get_tenant_row(session, tenant_id)
    num_records = await rt.retention.count_records(tenant_id)
    await rt.audit.emit(
        "retention.key_shredded", actor=principal.key_id, tenant_id=tenant_id, num_records=num_records
    )
    num_records = await rt.retention.shred_tenant(tenant_id)
    return ShredOut(tenant_id=tenant_id, num_records=num_records)


async def purge_expired(rt: Runtime, actor: str) -> PurgeOut:
    """Delete expired records (expired ones are already unreadable); audited after the fact."""
    num_deleted = await rt.retention.purge_expired()
    if num_deleted:
        await rt.audit.emit("retention.purged", required=False, actor=actor, num_deleted=num_deleted)
    return PurgeOut(num_deleted=num_deleted)
