"""Usage reports per tenant and window (JSON rows or CSV)."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.errors import InvalidRequest
from gateway.schemas.admin import UsageRow
from gateway.storage.models import UsageCounter
from gateway.tenancy.tenants import get_tenant_row

REPORT_WINDOWS = ("minute", "day", "month")


async def usage_report(
    session: AsyncSession, tenant_id: str, window: str, start: datetime | None, end: datetime | None
) -> list[UsageRow]:
    """Settled usage of one tenant per ``window``, for windows starting in ``[start, end)``."""
    if window not in REPORT_WINDOWS:
        raise InvalidRequest(f"window must be one of {', '.join(REPORT_WINDOWS)}.", param="window")
    await get_tenant_row(session, tenant_id)
    stmt = select(UsageCounter).where(UsageCounter.tenant_id == tenant_id, UsageCounter.window == window)
    if start is not None:
        stmt = stmt.where(UsageCounter.window_start >= int(start.timestamp()))
    if end is not None:
        stmt = stmt.where(UsageCounter.window_start < int(end.timestamp()))
    rows = await session.scalars(stmt.order_by(UsageCounter.window_start))
    return [_row(r) for r in rows]


def _row(r: UsageCounter) -> UsageRow:
    return UsageRow(
        tenant_id=r.tenant_id,
        window=r.window,
        window_start=datetime.fromtimestamp(r.window_start, UTC),
        num_requests=r.num_requests,
        prompt_tokens=r.num_prompt_tokens,
        completion_tokens=r.num_completion_tokens,
        cached_tokens=r.num_cached_tokens,
        total_tokens=r.num_prompt_tokens + r.num_completion_tokens,
    )


def to_csv(rows: list[UsageRow]) -> str:
    buf = io.StringIO()
    fields = list(UsageRow.model_fields)
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        data = row.model_dump()
        data["window_start"] = row.window_start.isoformat()
        writer.writerow(data)
    return buf.getvalue()


async def window_totals(session: AsyncSession, window: str, window_start: datetime) -> dict[str, UsageRow]:
    """Every tenant's settled usage in one window (tenants without usage in it are absent), by tenant id."""
    if window not in REPORT_WINDOWS:
        raise InvalidRequest(f"window must be one of {', '.join(REPORT_WINDOWS)}.", param="window")
    rows = await session.scalars(select(UsageCounter).where(
        UsageCounter.window == window, UsageCounter.window_start == int(window_start.timestamp())))
    return {r.tenant_id: _row(r) for r in rows}
