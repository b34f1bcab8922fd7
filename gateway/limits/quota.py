"""Rate limits and token quotas: reserve at admission, settle at finish, with atomic conditional UPDATEs.

Every counter moves only through ``UPDATE ... SET n = n + :d WHERE <pk> AND n + :d <= :limit RETURNING``,
so concurrent requests (also from several gateway processes sharing PostgreSQL) can never push a counter
past its limit: the row lock serialises writers and PostgreSQL re-checks the WHERE clause against the
latest committed row. ``reserve`` and ``settle`` both lock the tenant row first; that lock is then a
per-tenant mutex over the usage and slot rows, so two transactions cannot deadlock whatever order one
multi-row UPDATE locks its rows in.

Each call is one transaction body (``gateway.storage.txn``) of prebuilt statements
(``gateway.limits.usage_sql``): the concurrency slot (``gateway.limits.slots``), an idempotent insert
of the window rows, and one UPDATE for all three windows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection

from audit.prepared import execute, execute_many
from gateway.audit_hook import TxnStep
from gateway.errors import QuotaExceeded
from gateway.limits.ratelimit import (
    Hold,
    RateLimitInfo,
    TenantGate,
    exceeded,
    rate_limit_info,
    window_error,
)
from gateway.limits.slots import LOCK_TENANT, Slots
from gateway.limits.usage_sql import READ, SETTLE, WINDOWS, add_usage, ensure_row
from gateway.storage.txn import TxnRunner
from policies import Policy


@dataclass(frozen=True, slots=True)
class Reservation:
    """Tokens held for one admitted request, and the exact counter rows they were added to."""

    tenant_id: str
    num_tokens: int
    window_starts: tuple[int, int, int]  # minute, day, month (epoch seconds)
    instance_id: str  # the gateway instance holding its concurrency slot
    # Resolves once the reservation's transaction has committed, or fails if it did not (``reserve``
    # with ``is_early``); ``None``: committed before ``reserve`` returned.
    committed: asyncio.Future | None = field(default=None, compare=False, repr=False)
    # The request's place in the in-process gate (``QuotaService.gate``), given back by ``settle``.
    hold: Hold | None = field(default=None, compare=False, repr=False)


def window_bounds(now: float) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Starts and ends (epoch seconds, UTC) of the minute, day and month containing ``now``."""
    return _minute_bounds(int(now // 60) * 60)


@lru_cache(maxsize=4)
def _minute_bounds(minute: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    # Every window boundary is a whole minute, so one computation serves a whole minute of requests.
    day = minute // 86400 * 86400
    d = datetime.fromtimestamp(minute, UTC)
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


class _MissingRows(Exception):
    """A window row this process created earlier is gone; the reservation is retried from scratch."""


class _Refused(Exception):
    """A reservation over a window's limit: ``error`` for the caller, and the tenant's request count in
    the minute window for the gate."""

    def __init__(self, error: QuotaExceeded, num_minute_requests: int) -> None:
        super().__init__(error.message)
        self.error = error
        self.num_minute_requests = num_minute_requests


def _params(r: Reservation) -> dict[str, Any]:
    return {"tid": r.tenant_id, "n": r.num_tokens} | {
        f"{w}_start": s for w, s in zip(WINDOWS, r.window_starts, strict=True)
    }


class QuotaService:
    """Reserves and settles usage against a tenant's policy, each in one database transaction.

    Args:
        db: Runs the transactions.
        slots: This instance's concurrency slots and lease (a fresh instance by default).
    """

    def __init__(self, db: TxnRunner, slots: Slots | None = None) -> None:
        self._db = db
        self.slots = slots or Slots()
        self.gate = TenantGate()  # the same limits, checked early from what this process knows
        self._is_registered = False
        # tenant -> window starts whose usage rows are known to exist (rows are never deleted), so the
        # idempotent insert runs once per tenant per minute instead of on every request.
        self._known_rows: dict[str, tuple[int, int, int]] = {}

    async def heartbeat(self, now: float) -> None:
        """Renew this instance's lease (call well within ``slots.lease_s``)."""
        await self._db.run(self.slots.renew, now, durable=False, inline=True)
        self._is_registered = True

    async def release_all(self) -> None:
        """Give back every slot this instance holds and end its lease (clean shutdown)."""
        await self._db.run(self.slots.release_all)
        self._is_registered = False

    async def reserve(
        self,
        tenant_id: str,
        policy: Policy,
        num_tokens: int,
        now: float,
        *,
        then: TxnStep | None = None,
        is_early: bool = False,
        hold: Hold | None = None,
    ) -> tuple[Reservation, RateLimitInfo]:
        """Hold ``num_tokens`` and one request slot in every window, or raise ``QuotaExceeded``.

        Args:
            then: Runs in the same transaction once the reservation holds (the admission's audit event);
                if it raises, the reservation is rolled back with it.
            is_early: Return once the reservation is decided, before its commit is done: the caller may
                start work it can abort, and must wait for ``reservation.committed`` before anything of
                it is seen (``TxnRunner.run_early``). ``settle`` waits for it too.
            hold: The request's place in ``gate``. The reservation takes it over (``settle`` gives it
                back); when the reservation fails, it is given back here.
        """
        if not self._is_registered:
            await self.heartbeat(now)
        r = Reservation(tenant_id, num_tokens, window_bounds(now)[0], self.slots.instance_id, hold=hold)
        try:
            (info, num_minute_requests), committed = await self._run_reserve(r, policy, now, then, is_early)
        except BaseException as e:
            if hold is not None:
                hold.give()
            if isinstance(e, _Refused):  # the gate then refuses the rest of the minute on its own
                self.gate.observe(tenant_id, r.window_starts[0], e.num_minute_requests)
                raise e.error from None
            raise
        self._known_rows[tenant_id] = r.window_starts
        if hold is not None:
            hold.counted_once(committed, r.window_starts[0], num_minute_requests)
        return (r, info) if committed is None else (replace(r, committed=committed), info)

    async def _run_reserve(
        self, r: Reservation, policy: Policy, now: float, then: TxnStep | None, is_early: bool
    ) -> tuple[tuple[RateLimitInfo, int], asyncio.Future | None]:
        """``_reserve``'s result, and the future of its commit (``is_early``) or ``None``."""

        def release(conn: Connection, _: Any) -> None:
            self._settle(conn, r, 0, 0, 0, None)

        run = self._db.run_early if is_early else self._db.run
        try:
            outcome = await run(self._reserve, r, policy, now, then, undo=release, inline=True)
        except _MissingRows:
            self._known_rows.pop(r.tenant_id, None)
            outcome = await run(self._reserve, r, policy, now, then, undo=release, inline=True)
        return outcome if is_early else (outcome, None)

    def _reserve(
        self, conn: Connection, r: Reservation, policy: Policy, now: float, then: TxnStep | None
    ) -> tuple[RateLimitInfo, int]:
        params = _params(r)
        if not self.slots.take(conn, r.tenant_id, policy.max_concurrent_requests, now):
            raise exceeded("Too many concurrent requests for this tenant.", 1.0, "concurrency_limit")
        if self._known_rows.get(r.tenant_id) != r.window_starts:
            starts = zip(WINDOWS, r.window_starts, strict=True)
            rows = [{"tid": r.tenant_id, "w": w, "start": s} for w, s in starts]
            execute_many(conn, ensure_row(conn.dialect.name), rows)
        limits = _limits(policy)
        bounds = {f"{w}_tokens": t for w, (t, _) in zip(WINDOWS, limits, strict=True) if t is not None}
        bounds |= {f"{w}_requests": q for w, (_, q) in zip(WINDOWS, limits, strict=True) if q is not None}
        shape = tuple((t is not None, q is not None) for t, q in limits)
        added = execute(conn, add_usage(shape), params | bounds)
        got = {w: (tokens, requests) for w, tokens, requests in added}
        if len(got) < len(WINDOWS):  # raising rolls back the slot and the windows that did fit
            raise _rejection(conn, r, policy, got, now)
        if then is not None:
            then(conn)
        return rate_limit_info(policy, got["minute"], window_bounds(now)[1][0] - now), got["minute"][1]

    async def settle(
        self,
        reservation: Reservation,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        num_cached_tokens: int,
        *,
        then: TxnStep | None = None,
        unless: Callable[[Connection], bool] | None = None,
    ) -> None:
        """Replace the reservation by actual usage and release the concurrency slot.

        The commit is not waited to disk: an OS crash could lose only this refund of the unused part
        of a durable reservation (so usage is over-, never under-counted) and the slot, which lapses with
        this instance's lease.

        Args:
            then: Runs in the same transaction (the request's ``request.finished`` audit event).
            unless: Checked first in the transaction: when it returns true, nothing is done (a retried
                settlement whose earlier try committed after all).

        Raises:
            Exception: The reservation itself did not commit (``reserve`` with ``is_early``): there is
                nothing to settle, and nothing was.
        """
        if reservation.hold is not None:  # before any wait: the tenant's next request may come now
            reservation.hold.give()
        if reservation.committed is not None:
            await reservation.committed
        await self._db.run(
            self._settle,
            reservation,
            num_prompt_tokens,
            num_completion_tokens,
            num_cached_tokens,
            then,
            unless,
            durable=False,
            inline=True,
        )

    @staticmethod
    def _settle(
        conn: Connection, r: Reservation, num_prompt: int, num_completion: int, num_cached: int,
        then: TxnStep | None, unless: Callable[[Connection], bool] | None = None,
    ) -> None:
        if unless is not None and unless(conn):
            return
        params = _params(r) | {
            "delta": num_prompt + num_completion - r.num_tokens,
            "num_prompt": num_prompt,
            "num_completion": num_completion,
            "num_cached": num_cached,
        }
        execute(conn, LOCK_TENANT, params)
        Slots.give(conn, r.tenant_id, r.instance_id)
        execute(conn, SETTLE, params)
        if then is not None:
            then(conn)


def _rejection(
    conn: Connection, r: Reservation, policy: Policy, got: dict[str, tuple[int, int]], now: float
) -> _Refused:
    """The error for the first window (minute, day, month) the reservation did not fit in.

    Raises:
        _MissingRows: A window row does not exist (the caller retries, inserting the rows).
    """
    ends = window_bounds(now)[1]
    limits = _limits(policy)
    failed = next(i for i, w in enumerate(WINDOWS) if w not in got)
    error = window_error(WINDOWS[failed], r.num_tokens, limits[failed], ends[failed] - now)
    rows = {w: (tokens, requests) for w, tokens, requests in execute(conn, READ, _params(r))}
    if len(rows) < len(WINDOWS):
        raise _MissingRows  # not over a limit after all: the UPDATE had rows to miss
    minute = got.get("minute") or rows["minute"]
    error.headers |= rate_limit_info(policy, minute, ends[0] - now).headers()
    # The committed count: a minute that fit holds this request too, until the rollback.
    return _Refused(error, minute[1] - ("minute" in got))
