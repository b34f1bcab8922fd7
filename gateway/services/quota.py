"""Rate limits and token quotas: reserve at admission, settle at finish, with atomic conditional UPDATEs.

Every counter moves only through ``UPDATE ... SET n = n + :d WHERE <pk> AND n + :d <= :limit RETURNING``,
so concurrent requests (also from several gateway processes sharing PostgreSQL) can never push a counter
past its limit: the row lock serialises writers and PostgreSQL re-checks the WHERE clause against the
latest committed row. Rows are always locked in the same order (tenant, minute, day, month) in both
``reserve`` and ``settle``, so two transactions cannot deadlock.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.errors import QuotaExceeded
from gateway.storage.models import Tenant, UsageCounter
from policies import Policy

WINDOWS = ("minute", "day", "month")


@dataclass(frozen=True, slots=True)
class Reservation:
    """Tokens held for one admitted request, and the exact counter rows they were added to."""

    tenant_id: str
    num_tokens: int
    window_starts: tuple[int, int, int]  # minute, day, month (epoch seconds)


@dataclass(frozen=True, slots=True)
class RateLimitInfo:
    """Values for OpenAI's ``x-ratelimit-*`` headers (minute window)."""

    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_s: float

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        reset = f"{max(self.reset_s, 0.0):.3f}s"
        if self.limit_requests is not None:
            out |= {
                "x-ratelimit-limit-requests": str(self.limit_requests),
                "x-ratelimit-remaining-requests": str(max(self.remaining_requests or 0, 0)),
                "x-ratelimit-reset-requests": reset,
            }
        if self.limit_tokens is not None:
            out |= {
                "x-ratelimit-limit-tokens": str(self.limit_tokens),
                "x-ratelimit-remaining-tokens": str(max(self.remaining_tokens or 0, 0)),
                "x-ratelimit-reset-tokens": reset,
            }
        return out


def window_bounds(now: float) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Starts and ends (epoch seconds, UTC) of the minute, day and month containing ``now``."""
    minute = int(now // 60) * 60
    day = int(now // 86400) * 86400
    d = datetime.fromtimestamp(now, UTC)
    month = datetime(d.year, d.month, 1, tzinfo=UTC)
    next_month = datetime(d.year + d.month // 12, d.month % 12 + 1, 1, tzinfo=UTC)
    return (minute, day, int(month.timestamp())), (minute + 60, day + 86400, int(next_month.timestamp()))


def _limits(policy: Policy) -> tuple[tuple[int | None, int | None], ...]:
    """(token limit, request limit) per window."""
    return (
        (policy.tokens_per_minute, policy.requests_per_minute),
        (policy.daily_token_quota, None),
        (policy.monthly_token_quota, None),
    )


class QuotaService:
    """Reserves and settles usage against a tenant's policy."""

    def __init__(self, sessionmaker: async_sessionmaker, dialect: str) -> None:
        self._sessionmaker = sessionmaker
        self._dialect = dialect
        # SQLite has one writer at a time anyway; queueing here beats polling on busy_timeout.
        self._lock = asyncio.Lock() if dialect == "sqlite" else None

    async def _ensure_rows(self, session: AsyncSession, tenant_id: str, starts: tuple[int, ...]) -> None:
        dialect_insert = postgresql.insert if self._dialect == "postgresql" else sqlite.insert
        rows = [
            {
                "tenant_id": tenant_id,
                "window": w,
                "window_start": s,
                "num_requests": 0,
                "num_tokens": 0,
                "num_prompt_tokens": 0,
                "num_completion_tokens": 0,
                "num_cached_tokens": 0,
            }
            for w, s in zip(WINDOWS, starts, strict=True)
        ]
        await session.execute(dialect_insert(UsageCounter).values(rows).on_conflict_do_nothing())

    async def _take_slot(self, session: AsyncSession, tenant_id: str, limit: int | None) -> bool:
        stmt = update(Tenant).where(Tenant.id == tenant_id)
        if limit is not None:
            stmt = stmt.where(Tenant.num_in_flight + 1 <= limit)
        result = await session.execute(
            stmt.values(num_in_flight=Tenant.num_in_flight + 1).returning(Tenant.num_in_flight)
        )
        return result.first() is not None

    async def _add(
        self,
        session: AsyncSession,
        tenant_id: str,
        window: str,
        start: int,
        num_tokens: int,
        limits: tuple[int | None, int | None],
    ) -> tuple[int, int] | None:
        token_limit, request_limit = limits
        stmt = update(UsageCounter).where(
            UsageCounter.tenant_id == tenant_id,
            UsageCounter.window == window,
            UsageCounter.window_start == start,
        )
        if token_limit is not None:
            stmt = stmt.where(UsageCounter.num_tokens + num_tokens <= token_limit)
        if request_limit is not None:
            stmt = stmt.where(UsageCounter.num_requests + 1 <= request_limit)
        stmt = stmt.values(
            num_tokens=UsageCounter.num_tokens + num_tokens, num_requests=UsageCounter.num_requests + 1
        )
        row = (
            await session.execute(stmt.returning(UsageCounter.num_tokens, UsageCounter.num_requests))
        ).first()
        return None if row is None else (row[0], row[1])

    async def _read_minute(self, session: AsyncSession, tenant_id: str, start: int) -> tuple[int, int]:
        row = (
            await session.execute(
                select(UsageCounter.num_tokens, UsageCounter.num_requests).where(
                    UsageCounter.tenant_id == tenant_id,
                    UsageCounter.window == "minute",
                    UsageCounter.window_start == start,
                )
            )
        ).first()
        return (0, 0) if row is None else (row[0], row[1])

    async def reserve(
        self, tenant_id: str, policy: Policy, num_tokens: int, now: float
    ) -> tuple[Reservation, RateLimitInfo]:
        """Hold ``num_tokens`` and one request slot in every window, or raise ``QuotaExceeded``."""
        if self._lock is None:
            return await self._reserve(tenant_id, policy, num_tokens, now)
        async with self._lock:
            return await self._reserve(tenant_id, policy, num_tokens, now)

    async def _reserve(
        self, tenant_id: str, policy: Policy, num_tokens: int, now: float
    ) -> tuple[Reservation, RateLimitInfo]:
        starts, ends = window_bounds(now)
        limits = _limits(policy)
        async with self._sessionmaker() as session, session.begin():
            if not await self._take_slot(session, tenant_id, policy.max_concurrent_requests):
                raise _exceeded("Too many concurrent requests for this tenant.", 1.0, "concurrency_limit")
            await self._ensure_rows(session, tenant_id, starts)
            minute: tuple[int, int] | None = None
            for i, window in enumerate(WINDOWS):
                got = await self._add(session, tenant_id, window, starts[i], num_tokens, limits[i])
                if got is None:  # raising inside begin() rolls back the slot and earlier windows
                    error = _window_error(window, num_tokens, limits[i], ends[i] - now)
                    row = minute or await self._read_minute(session, tenant_id, starts[0])
                    error.headers |= _info(policy, row, ends[0] - now).headers()
                    raise error
                minute = minute or got
        assert minute is not None
        info = _info(policy, minute, ends[0] - now)
        return Reservation(tenant_id, num_tokens, starts), info

    async def settle(
        self,
        reservation: Reservation,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        num_cached_tokens: int,
    ) -> None:
        """Replace the reservation by actual usage and release the concurrency slot."""
        if self._lock is None:
            await self._settle(reservation, num_prompt_tokens, num_completion_tokens, num_cached_tokens)
            return
        async with self._lock:
            await self._settle(reservation, num_prompt_tokens, num_completion_tokens, num_cached_tokens)

    async def _settle(self, r: Reservation, num_prompt: int, num_completion: int, num_cached: int) -> None:
        delta = num_prompt + num_completion - r.num_tokens
        async with self._sessionmaker() as session, session.begin():
            await session.execute(
                update(Tenant).where(Tenant.id == r.tenant_id).values(num_in_flight=Tenant.num_in_flight - 1)
            )
            for window, start in zip(WINDOWS, r.window_starts, strict=True):
                await session.execute(
                    update(UsageCounter)
                    .where(
                        UsageCounter.tenant_id == r.tenant_id,
                        UsageCounter.window == window,
                        UsageCounter.window_start == start,
                    )
                    .values(
                        num_tokens=UsageCounter.num_tokens + delta,
                        num_prompt_tokens=UsageCounter.num_prompt_tokens + num_prompt,
                        num_completion_tokens=UsageCounter.num_completion_tokens + num_completion,
                        num_cached_tokens=UsageCounter.num_cached_tokens + num_cached,
                    )
                )


def _info(policy: Policy, minute: tuple[int, int], reset_s: float) -> RateLimitInfo:
    tokens, requests = minute
    rpm, tpm = policy.requests_per_minute, policy.tokens_per_minute
    return RateLimitInfo(
        rpm, None if rpm is None else rpm - requests, tpm, None if tpm is None else tpm - tokens, reset_s
    )


def _exceeded(message: str, retry_after: float, code: str) -> QuotaExceeded:
    return QuotaExceeded(message, code=code, headers={"retry-after": str(max(1, math.ceil(retry_after)))})


def _window_error(
    window: str, num_tokens: int, limits: tuple[int | None, int | None], retry_after: float
) -> QuotaExceeded:
    token_limit, _ = limits
    if token_limit is not None and num_tokens > token_limit:
        return _exceeded(
            f"Request too large: it needs {num_tokens} tokens; the {window} limit is {token_limit}.",
            retry_after,
            "request_too_large",
        )
    if window == "minute":
        return _exceeded(
            "Rate limit reached for requests or tokens per minute.", retry_after, "rate_limit_exceeded"
        )
    return _exceeded(
        f"The {'daily' if window == 'day' else 'monthly'} token quota is exhausted.",
        retry_after,
        "insufficient_quota",
    )
