"""Console pages for usage (charts per hour and day, CSV) and the engine's live view."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from litestar import Controller, Request, Response, get
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.charts import bar_chart, buckets, per_bucket
from gateway.console.guard import CONSOLE_SCOPE
from gateway.console.views import SECURITY_HEADERS, page
from gateway.errors import InvalidRequest
from gateway.runtime import Runtime
from gateway.schemas.admin import ADMIN_READ
from gateway.tenancy import tenants, usage

# window shown -> (the stored window it is summed from, how many buckets, their label format)
_VIEWS = {"hour": ("minute", 48, "%d %H:00"), "day": ("day", 30, "%m-%d")}


def _charts(rows: list, window: str, now: datetime) -> list:
    _, count, fmt = _VIEWS[window]
    starts = buckets(window, now, count)
    sums = per_bucket(rows, starts, window)
    labels = [s.strftime(fmt) for s in starts]
    return [
        bar_chart(f"Requests per {window}", labels, [("requests", "#3b6fb6", sums["requests"])]),
        bar_chart(f"Tokens per {window}", labels, [("prompt tokens", "#6a9f3a", sums["prompt"]),
                                                     ("completion tokens", "#d08a2c", sums["completion"])]),
    ]


@dataclass(frozen=True, slots=True)
class TenantLive:
    id: str
    name: str
    waiting: int
    running: int
    kv_blocks: int
    cache_hit_rate: float | None  # today's cached prompt tokens / prompt tokens


async def _live(runtime: Runtime, session: AsyncSession) -> dict:
    """The engine's figures now (those of ``/metrics``) and each tenant's share of them."""
    stats = runtime.engine.stats()
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    totals = await usage.window_totals(session, "day", today)
    rows = []
    for t in await tenants.list_tenants(session):
        figures = stats.tenants.get(t.id.encode(), {})
        day = totals.get(t.id)
        rate = day.cached_tokens / day.prompt_tokens if day is not None and day.prompt_tokens else None
        rows.append(TenantLive(t.id, t.name, figures.get("waiting", 0), figures.get("running", 0),
                               figures.get("kv_blocks", 0), rate))
    queries = stats.prefix_cache_queries
    return {"stats": stats, "tenants": rows, "at": datetime.now(UTC),
            "hit_rate": stats.prefix_cache_hits / queries if queries else None,
            "kv_ratio": stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1)}


class UsageController(Controller):
    path = "/"

    @get("/tenants/{tenant_id:str}/usage", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def usage_page(self, request: Request, session: AsyncSession, tenant_id: str,
                         window: str = "hour") -> Response:
        """Requests and tokens per hour (last 48) or day (last 30) as charts, with CSV downloads."""
        if window not in _VIEWS:
            raise InvalidRequest("window must be hour or day.", param="window")
        stored, count, _ = _VIEWS[window]
        now = datetime.now(UTC)
        start = buckets(window, now, count)[0]
        rows = await usage.usage_report(session, tenant_id, stored, start, now + timedelta(minutes=1))
        return page("usage.html", console=request.state.console, csrf=request.state.csrf,
                    tenant=await tenants.get_tenant(session, tenant_id), window=window,
                    charts=_charts(rows, window, now), total_requests=sum(r.num_requests for r in rows),
                    total_tokens=sum(r.total_tokens for r in rows))

    @get("/tenants/{tenant_id:str}/usage/csv", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def usage_csv(self, session: AsyncSession, tenant_id: str, window: str = "day") -> Response:
        """Settled usage of the tenant per minute (the last 48 hours, as the hourly chart), day or month
        (all), as the API's CSV."""
        since = datetime.now(UTC) - timedelta(hours=48) if window == "minute" else None
        rows = await usage.usage_report(session, tenant_id, window, since, None)
        name = f"kvgate-usage-{tenant_id}-{window}.csv"
        return Response(usage.to_csv(rows), media_type="text/csv", headers=SECURITY_HEADERS | {
            "content-disposition": f'attachment; filename="{name}"'})

    @get("/engine", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def engine(self, request: Request, session: AsyncSession, runtime: Runtime) -> Response:
        """The engine now: KV blocks in use, queue, tokens/s, prefix-cache hits, and per tenant."""
        return page("engine.html", console=request.state.console, csrf=request.state.csrf,
                    **await _live(runtime, session))

    @get("/engine/live", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def engine_live(self, session: AsyncSession, runtime: Runtime) -> Response:
        """The engine view's figures alone, which the page reloads every few seconds."""
        return page("engine_live.html", **await _live(runtime, session))
