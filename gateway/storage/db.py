"""Async SQLAlchemy engine and sessionmaker for SQLite (default) or PostgreSQL."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event, exc
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool

# A pooled PostgreSQL connection is pinged before use only when it has sat in the pool this long.
# SQLAlchemy's ``pool_pre_ping`` pings on every checkout, and its asyncpg ping is BEGIN, an empty query
# and ROLLBACK: three round trips before each transaction, nine a completion request. A connection used
# moments ago is alive unless its server just went away, which its first statement then finds (that
# transaction fails, and SQLAlchemy invalidates the pool, so the next ones reconnect).
IDLE_PING_S = 5.0
_CHECKED_IN_AT = "kvgate_checked_in_at"
# SQLSTATEs of a PostgreSQL server that is going away or not there yet: the connection failures (class
# 08), and a shutdown or start-up under way (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03
# cannot_connect_now). Like a lost connection, each passes once the server is back.
_UNAVAILABLE_STATES = ("08", "57P01", "57P02", "57P03")


def default_db_url(data_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{data_dir / 'kvgate.db'}"


def normalize_db_url(url: str) -> str:
    """Accept plain ``postgresql://``/``sqlite://`` URLs and pick the async driver."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + url.split("://", 1)[1]
    if url.startswith("sqlite://"):
        return "sqlite+aiosqlite://" + url.split("://", 1)[1]
    return url


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


BUSY_TIMEOUT_MS = 10_000


def sqlite_pragmas(dbapi_conn, _record, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:  # type: ignore[no-untyped-def]
    cur = dbapi_conn.cursor()
    # busy_timeout first: even switching to WAL needs a lock another connection may hold.
    # WAL lets readers proceed during writes; busy_timeout makes concurrent writers wait, not fail.
    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def make_db_engine(url: str, *, null_pool: bool = False) -> AsyncEngine:
    """An async engine; ``null_pool`` opens a connection per session (PgBouncer, or several event loops)."""
    url = normalize_db_url(url)
    if null_pool:
        engine = create_async_engine(url, poolclass=NullPool)
        if is_sqlite(url):
            event.listen(engine.sync_engine, "connect", sqlite_pragmas)
            return engine
        return _watch_availability(engine)
    if is_sqlite(url):
        engine = create_async_engine(url, pool_size=5, max_overflow=10)
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        return engine
    engine = _watch_availability(create_async_engine(url, pool_size=10, max_overflow=20))
    event.listen(engine.sync_engine.pool, "checkin", _note_checkin)
    event.listen(engine.sync_engine.pool, "checkout", _ping_if_idle)
    return engine


def _watch_availability(engine: AsyncEngine) -> AsyncEngine:
    """Make every sign that the PostgreSQL server is out of reach a ``DBAPIError`` with
    ``connection_invalidated`` (``is_db_unavailable``), as SQLAlchemy already makes a connection lost
    mid-statement: a refused connect (a raw ``OSError`` from asyncpg otherwise) and a server shutting
    down or starting up (otherwise a plain database error, which the gateway answers with a 500)."""
    event.listen(engine.sync_engine, "do_connect", _connect)
    event.listen(engine.sync_engine, "handle_error", _mark_unavailable)
    return engine


def _connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
    try:
        return dialect.connect(*cargs, **cparams)
    except OSError as e:  # refused, unreachable, timed out (TimeoutError is an OSError)
        raise exc.OperationalError("connect", None, e, connection_invalidated=True) from e


def _mark_unavailable(context: Any) -> None:
    state = getattr(context.original_exception, "sqlstate", None) or ""
    if state.startswith(_UNAVAILABLE_STATES):
        context.is_disconnect = True


def is_db_full(error: BaseException | None) -> bool:
    """Whether ``error``, or an error that caused it, is the database unable to grow: SQLite's
    ``SQLITE_FULL`` (its disk is full; the transaction wrote nothing), whether SQLAlchemy wrapped it or not.
    It passes once there is room again."""
    while error is not None:
        orig = error.orig if isinstance(error, exc.DBAPIError) else error
        if isinstance(orig, sqlite3.Error) and (orig.sqlite_errorcode & 0xFF) == sqlite3.SQLITE_FULL:
            return True
        error = error.__cause__
    return False


def is_db_transient(error: BaseException | None) -> bool:
    """Whether ``error`` is a database condition that passes by itself (``is_db_unavailable``,
    ``is_db_full``): work that must be written is worth retrying."""
    return is_db_unavailable(error) or is_db_full(error)


def is_db_unavailable(error: BaseException | None) -> bool:
    """Whether ``error``, or an error that caused it, is the database out of reach (its server down,
    restarting or the connection lost): a condition that passes, so a client may retry."""
    while error is not None:
        if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
            return True
        error = error.__cause__
    return False


def _note_checkin(dbapi_conn: Any, record: Any) -> None:
    if dbapi_conn is not None:  # None: the connection was invalidated
        record.info[_CHECKED_IN_AT] = time.monotonic()


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Ping a connection idle for ``IDLE_PING_S`` or more (``record.info`` starts empty for a new one).

    Raises:
        DisconnectionError: It does not answer; the pool drops it and checks out another.
    """
    checked_in_at = record.info.get(_CHECKED_IN_AT)
    if checked_in_at is None or time.monotonic() - checked_in_at < IDLE_PING_S:
        return
    try:
        dbapi_conn.ping()
    except Exception as e:  # noqa: BLE001  (whatever a dead connection raises)
        raise exc.DisconnectionError(f"pooled connection idle {IDLE_PING_S:g}s+ did not answer") from e


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)
