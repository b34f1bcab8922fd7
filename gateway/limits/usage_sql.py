"""The usage-counter statements of quota reservations and settlements, each built once per shape."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from sqlalchemy import BigInteger, and_, bindparam, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert, Update

from gateway.storage.models import UsageCounter

WINDOWS = ("minute", "day", "month")

_U = UsageCounter.__table__
_N = bindparam("n", type_=BigInteger)


def _window_is(window: str) -> Any:
    return and_(_U.c.window == window, _U.c.window_start == bindparam(f"{window}_start", type_=BigInteger))


_IS_TENANT_WINDOW = and_(_U.c.tenant_id == bindparam("tid"), or_(*(_window_is(w) for w in WINDOWS)))
READ = select(_U.c.window, _U.c.num_tokens, _U.c.num_requests).where(_IS_TENANT_WINDOW)
SETTLE = (
    update(_U)
    .where(_IS_TENANT_WINDOW)
    .values(
        num_tokens=_U.c.num_tokens + bindparam("delta", type_=BigInteger),
        num_prompt_tokens=_U.c.num_prompt_tokens + bindparam("num_prompt", type_=BigInteger),
        num_completion_tokens=_U.c.num_completion_tokens + bindparam("num_completion", type_=BigInteger),
        num_cached_tokens=_U.c.num_cached_tokens + bindparam("num_cached", type_=BigInteger),
    )
)


@lru_cache(maxsize=4)
def ensure_row(dialect: str) -> Insert:
    # One row per execution (run as an executemany): a multi-row VALUES with bind parameters is
    # compiled afresh on every call, which cost more than the rest of the reservation.
    dialect_insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    zeros = dict.fromkeys(
        ("num_requests", "num_tokens", "num_prompt_tokens", "num_completion_tokens", "num_cached_tokens"), 0
    )
    return (
        dialect_insert(_U)
        .values(tenant_id=bindparam("tid"), window=bindparam("w"), window_start=bindparam("start"), **zeros)
        .on_conflict_do_nothing()
    )


@lru_cache(maxsize=64)
def add_usage(limited: tuple[tuple[bool, bool], ...]) -> Update:
    """One UPDATE adding a request and ``n`` tokens to every window that stays within its limits."""
    clauses = []
    for window, (has_token_limit, has_request_limit) in zip(WINDOWS, limited, strict=True):
        clause = _window_is(window)
        if has_token_limit:
            clause = and_(clause, _U.c.num_tokens + _N <= bindparam(f"{window}_tokens", type_=BigInteger))
        if has_request_limit:
            clause = and_(clause, _U.c.num_requests + 1 <= bindparam(f"{window}_requests", type_=BigInteger))
        clauses.append(clause)
    return (
        update(_U)
        .where(_U.c.tenant_id == bindparam("tid"), or_(*clauses))
        .values(num_tokens=_U.c.num_tokens + _N, num_requests=_U.c.num_requests + 1)
        .returning(_U.c.window, _U.c.num_tokens, _U.c.num_requests)
    )
