"""SQLite reads on the caller's thread: short read-only bodies, each in its own rolled-back snapshot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL

from gateway.storage.db import BUSY_TIMEOUT_MS
from gateway.storage.sqlite_conn import connect_sqlite, rollback
from gateway.storage.sqlite_writer import LOOP_BUSY_MS


def _begin_deferred(conn: Connection) -> None:
    if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN")  # (a held reader connection may have begun it directly)


class SqliteReader:
    """Read-only transaction bodies on the calling thread, each in a ``BEGIN`` (deferred) transaction
    that is rolled back: one snapshot per body, and never a write lock.

    Two pools: an impatient one (``LOOP_BUSY_MS``) for the event loop, whose ``OperationalError`` the
    caller answers by retrying on the patient one (the usual busy timeout) in a worker thread. The event
    loop keeps its one connection checked out and begins and ends each snapshot on it directly: a pool
    checkout and SQLAlchemy's transaction bookkeeping cost three times the key lookup they wrap.
    """

    def __init__(self, url: URL) -> None:
        self._impatient = _reader_engine(url, LOOP_BUSY_MS, pool_size=1)
        self._patient = _reader_engine(url, BUSY_TIMEOUT_MS, pool_size=2)
        self._held: Connection | None = None  # the event loop's, used from that thread only

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], *, is_patient: bool) -> Any:
        if not is_patient:
            return self._run_held(fn, args)
        with self._patient.connect() as conn:
            with conn.begin() as txn:
                try:
                    return fn(conn, *args)
                finally:
                    txn.rollback()

    def _run_held(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self._held is None:
            self._held = self._impatient.connect()
        conn = self._held
        raw = conn.connection.dbapi_connection
        raw.execute("BEGIN")  # type: ignore[union-attr]
        try:
            return fn(conn, *args)
        finally:
            rollback(conn)  # SQLAlchemy's bookkeeping too, if fn's own execution began it

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
        self._impatient.dispose()
        self._patient.dispose()


def _reader_engine(url: URL, busy_timeout_ms: int, pool_size: int) -> Engine:
    engine = create_engine(url.set(drivername="sqlite"), pool_size=pool_size, max_overflow=8)
    event.listen(engine, "connect", lambda c, r: connect_sqlite(c, r, busy_timeout_ms))
    event.listen(engine, "begin", _begin_deferred)
    return engine
