"""SQLite connections for the writer and the readers: pragmas, and transactions on the DBAPI connection."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection

from gateway.storage.db import BUSY_TIMEOUT_MS, sqlite_pragmas


def connect_sqlite(dbapi_conn: Any, record: Any, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
    sqlite_pragmas(dbapi_conn, record, busy_timeout_ms)
    record.info["busy_timeout_ms"] = busy_timeout_ms
    # Let SQLAlchemy emit BEGIN itself (below): pysqlite's implicit BEGIN breaks SAVEPOINT.
    dbapi_conn.isolation_level = None


def begin_immediate(conn: Connection) -> None:
    # Take the write lock up front: a read-then-write body can never hit SQLITE_BUSY_SNAPSHOT, and a
    # writer in another process is waited for (busy_timeout) instead of failing the group half-way.
    if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # (the writer's groups begin it directly)


@contextmanager
def immediate_transaction(conn: Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` .. ``COMMIT`` straight on the DBAPI connection: SQLAlchemy's transaction
    bookkeeping costs ~0.1 ms a transaction, as much as a reservation's statements. A body that uses
    SQLAlchemy's own execution, or a group's savepoints, makes SQLAlchemy begin its bookkeeping inside
    this transaction (``begin_immediate`` sees it open); it is then ended through SQLAlchemy."""
    conn.connection.dbapi_connection.execute("BEGIN IMMEDIATE")  # type: ignore[union-attr]
    try:
        yield
        commit(conn)
    except BaseException:
        rollback(conn)
        raise


def commit(conn: Connection) -> None:
    if conn.in_transaction():
        conn.commit()
    else:
        conn.connection.dbapi_connection.commit()  # type: ignore[union-attr]


def rollback(conn: Connection) -> None:
    txn = conn.get_transaction()  # also one a failed commit left inactive, which in_transaction() hides
    if txn is not None:
        txn.rollback()
    raw = conn.connection.dbapi_connection
    if raw.in_transaction:  # type: ignore[union-attr]
        raw.rollback()  # type: ignore[union-attr]  (also after a failed COMMIT, which leaves it open)


def is_stuck(conn: Connection) -> bool:
    """A connection that is still inside a transaction after the group's rollback (it failed too)."""
    try:
        return bool(conn.connection.dbapi_connection.in_transaction)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001  (closed or broken: not worth keeping either)
        return True


def set_pragmas(conn: Connection, is_durable: bool, busy_timeout_ms: int) -> None:
    """Synchronous ``FULL`` waits for the disk at commit; ``NORMAL`` (WAL) does not, and loses nothing on
    a crash of this process. Set outside the transaction, on the raw connection, before BEGIN."""
    info, raw = conn.connection.info, conn.connection.dbapi_connection
    level = "FULL" if is_durable else "NORMAL"
    if info.get("synchronous") != level:
        raw.execute(f"PRAGMA synchronous={level}")  # type: ignore[union-attr]
        info["synchronous"] = level
    if info.get("busy_timeout_ms") != busy_timeout_ms:
        raw.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")  # type: ignore[union-attr]
        info["busy_timeout_ms"] = busy_timeout_ms
