"""Prebuilt Core statements run straight on the DBAPI cursor: the hot path's SQL without the ORM toll.

SQLAlchemy spends ~0.1 ms of Python per ``Connection.execute`` on a statement it has already compiled
(cache lookup, parameter construction, result set-up, events), several times what SQLite takes to run a
primary-key UPDATE. Each request runs a dozen such statements (key lookup, quota reservation and
settlement, audit chaining), all on the one SQLite writer thread that also holds the GIL the event loop
needs. Here a statement is compiled once per dialect into its SQL text, its positional parameter order,
its literal defaults and its type processors; a call is then one ``cursor.execute``, inside whatever
transaction the caller's SQLAlchemy ``Connection`` has open (the same DBAPI connection).

SQLite through the standard ``sqlite3`` driver takes this path, its errors raised as ``sqlite3``'s own;
so does PostgreSQL through SQLAlchemy's asyncpg adapter (its DBAPI cursor, from inside the greenlet a
``run_sync`` body runs in; ~25 us of Python a statement fewer hot, of a dozen and a half a request), its
errors wrapped as SQLAlchemy's ``DBAPIError`` subclasses as ``Connection.execute`` would (a lost
connection invalidated, and the pool with it). Other drivers (aiosqlite's adapted cursor, for in-memory
databases) and statements that cannot be run this way (post-compile parameters) keep
``Connection.execute``. Lives in ``audit`` because the audit store needs it and ``audit`` imports nothing
from the project; the gateway uses it from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.base import Executable

_MISSING = object()


@dataclass(frozen=True, slots=True)
class _Plan:
    sql: str
    # Per positional parameter: its name, its literal value (``_MISSING``: the caller must give it) and
    # its bind processor (``None``: the value goes to the driver as it is).
    params: tuple[tuple[str, Any, Callable[[Any], Any] | None], ...]
    # Per result column its result processor; ``None`` when no column needs one.
    results: tuple[Callable[[Any], Any] | None, ...] | None


# (id(statement), dialect name) -> (statement, plan). Keeping the statement alive keeps its id from being
# reused; only long-lived statements (module constants, small lru_caches) are ever passed in.
_PLANS: dict[tuple[int, str], tuple[Executable, _Plan | None]] = {}


def _plan(stmt: Executable, conn: Connection) -> _Plan | None:
    key = (id(stmt), conn.dialect.name)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is stmt:
        return hit[1]
    plan = _compile(stmt, conn)
    _PLANS[key] = (stmt, plan)
    return plan


def _compile(stmt: Executable, conn: Connection) -> _Plan | None:
    dialect = conn.dialect
    compiled = stmt.compile(dialect=dialect)  # type: ignore[attr-defined]
    if compiled.positiontup is None or "POSTCOMPILE" in compiled.string:
        return None
    processors = compiled._bind_processors
    params = []
    for name in compiled.positiontup:
        bind = compiled.binds[name]
        value = _MISSING if bind.required or bind.callable is not None else bind.value
        params.append((name, value, processors.get(name)))
    results = tuple(
        column[3]._cached_result_processor(dialect, None) for column in compiled._result_columns
    )
    return _Plan(compiled.string, tuple(params), results if any(results) else None)


def _is_direct(conn: Connection) -> bool:
    # aiosqlite's adapted cursor (in-memory databases, via run_sync) keeps SQLAlchemy's path.
    return conn.dialect.driver in ("pysqlite", "asyncpg")


def _run(conn: Connection, sql: str, values: Any, *, is_many: bool = False) -> list[Any]:
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        if is_many:
            cursor.executemany(sql, values)
            return []
        cursor.execute(sql, values)
        return cursor.fetchall() if cursor.description is not None else []
    except Exception as e:
        if conn.dialect.driver != "asyncpg" or not isinstance(e, conn.dialect.loaded_dbapi.Error):
            raise
        raise _wrapped(conn, sql, values, e) from e
    finally:
        cursor.close()


def _wrapped(conn: Connection, sql: str, values: Any, e: Exception) -> DBAPIError:
    """``e`` as ``Connection.execute`` raises it; a lost connection is invalidated, and so is the pool
    (a fresh one replaces it; connections checked out now are dropped when they come back), as the
    server that dropped this connection dropped its siblings too."""
    dialect = conn.dialect
    is_lost = dialect.is_disconnect(e, conn.connection.dbapi_connection, None)
    if is_lost:
        conn.invalidate(e)
        conn.engine.dispose(close=False)
    return DBAPIError.instance(sql, values, e, dialect.loaded_dbapi.Error, connection_invalidated=is_lost,
                               dialect=dialect)


def _values(plan: _Plan, given: Mapping[str, Any]) -> tuple[Any, ...]:
    out = []
    for name, literal, processor in plan.params:
        value = given[name] if literal is _MISSING else literal
        out.append(value if processor is None else processor(value))
    return tuple(out)


def execute(conn: Connection, stmt: Executable, params: Mapping[str, Any] | None = None) -> list[Any]:
    """Run ``stmt`` with ``params`` in ``conn``'s current transaction.

    Returns:
        All result rows as tuples (SQLite) or ``Row`` objects (elsewhere); ``[]`` when it returns none.

    Raises:
        KeyError: A required bound parameter is missing from ``params``.
    """
    given = params or {}
    plan = _plan(stmt, conn) if _is_direct(conn) else None
    if plan is None:
        result = conn.execute(stmt, dict(given))
        return list(result.all()) if result.returns_rows else []
    rows = _run(conn, plan.sql, _values(plan, given))
    if plan.results is None:
        return rows
    procs = plan.results
    return [tuple(v if p is None else p(v) for p, v in zip(procs, row, strict=True)) for row in rows]


def execute_many(conn: Connection, stmt: Executable, rows: Sequence[Mapping[str, Any]]) -> None:
    """Run a statement that returns nothing once per parameter set in ``rows`` (one driver call)."""
    if not rows:
        return
    plan = _plan(stmt, conn) if _is_direct(conn) else None
    if plan is None:
        conn.execute(stmt, [dict(r) for r in rows])
        return
    _run(conn, plan.sql, [_values(plan, r) for r in rows], is_many=True)
