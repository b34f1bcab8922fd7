"""SQLite group commit: one writer thread runs queued transaction bodies together, one commit per group;
and a reader that runs short read-only bodies on the caller's thread."""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL

from gateway.storage.db import BUSY_TIMEOUT_MS, sqlite_pragmas

MAX_GROUP = 64
# How long an in-loop read waits for SQLite's lock before it is handed to a worker thread instead.
READER_BUSY_MS = 20


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    is_durable: bool
    ctx: contextvars.Context
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    # Resolved with the body's result (or error) as soon as the body has run, before the group commits.
    decided: asyncio.Future | None = None


def _connect(dbapi_conn: Any, record: Any, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
    sqlite_pragmas(dbapi_conn, record, busy_timeout_ms)
    # Let SQLAlchemy emit BEGIN itself (below): pysqlite's implicit BEGIN breaks SAVEPOINT.
    dbapi_conn.isolation_level = None


def _begin_deferred(conn: Connection) -> None:
    if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN")  # (a held reader connection may have begun it directly)


def _begin_immediate(conn: Connection) -> None:
    # Take the write lock up front: a read-then-write body can never hit SQLITE_BUSY_SNAPSHOT, and a
    # writer in another process is waited for (busy_timeout) instead of failing the group half-way.
    if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # (the writer's groups begin it directly)


@contextmanager
def _immediate_transaction(conn: Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` .. ``COMMIT`` straight on the DBAPI connection: SQLAlchemy's transaction
    bookkeeping costs ~0.1 ms a transaction, as much as a reservation's statements. A body that uses
    SQLAlchemy's own execution, or a group's savepoints, makes SQLAlchemy begin its bookkeeping inside
    this transaction (``_begin_immediate`` sees it open); it is then ended through SQLAlchemy."""
    raw = conn.connection.dbapi_connection
    raw.execute("BEGIN IMMEDIATE")  # type: ignore[union-attr]
    try:
        yield
        if conn.in_transaction():
            conn.commit()
        else:
            raw.commit()  # type: ignore[union-attr]
    except BaseException:
        txn = conn.get_transaction()  # also one a failed commit left inactive, which in_transaction() hides
        if txn is not None:
            txn.rollback()
        if raw.in_transaction:  # type: ignore[union-attr]
            raw.rollback()  # type: ignore[union-attr]  (also after a failed COMMIT, which leaves it open)
        raise


def resolve(future: asyncio.Future, is_ok: bool, value: Any) -> None:
    """Settle ``future`` with a result or an error unless it is settled already (a cancellation cancels)."""
    if future.done():
        return
    if is_ok:
        future.set_result(value)
    elif isinstance(value, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(value)


def _resolve_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future, is_ok: bool, value: Any) -> None:
    try:
        loop.call_soon_threadsafe(resolve, future, is_ok, value)
    except RuntimeError:  # that event loop is closed: nobody is waiting any more
        pass


class SqliteWriter:
    """This process's only writer thread for one SQLite file, committing bodies in groups.

    Bodies queued while a group runs form the next group. Each body runs in its own SAVEPOINT, so its
    error rolls back only its own writes; the group commits once. Under load that is one fsync for many
    requests; alone, a body runs without a savepoint and costs what a single transaction costs. A
    body's result is handed back only after the group's commit, so nobody acts on uncommitted writes,
    except through ``decided``: a caller that asks for it must hold back anything visible until the commit.
    """

    def __init__(self, url: URL) -> None:
        self._engine = create_engine(url.set(drivername="sqlite"), pool_size=1, max_overflow=0)
        event.listen(self._engine, "connect", _connect)
        event.listen(self._engine, "begin", _begin_immediate)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._held: Connection | None = None  # the writer thread's, kept checked out between groups
        self._thread = threading.Thread(target=self._run, name="kvgate-sqlite-writer", daemon=True)
        self._thread.start()

    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        is_durable: bool,
        decided: asyncio.Future | None = None,
    ) -> asyncio.Future:
        """Queue ``fn(conn, *args)``; the future resolves once its group has committed (or failed).

        ``decided``, if given, resolves as soon as the body has run, before the commit (which may still fail).
        """
        loop = asyncio.get_running_loop()
        # The context (request ids, redaction hints) goes with the body to the writer thread.
        job = _Job(fn, args, is_durable, contextvars.copy_context(), loop, loop.create_future(), decided)
        self._jobs.put(job)
        return job.future

    def close(self) -> None:
        """Finish the queued bodies and stop (blocking)."""
        self._jobs.put(None)
        self._thread.join()
        self._engine.dispose()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            group = [job]
            while len(group) < MAX_GROUP:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)  # stop after this group
                    break
                group.append(job)
            self._run_group(group)
        self._drop_connection()

    def _connection(self) -> Connection:
        if self._held is None:
            self._held = self._engine.connect()
        return self._held

    def _drop_connection(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            try:
                held.close()
            except Exception:  # noqa: BLE001  (a broken connection may fail to close; the thread must live on)
                with suppress(Exception):
                    held.invalidate()

    def _run_group(self, group: list[_Job]) -> None:
        outcomes: list[tuple[bool, Any]] = []
        try:
            conn = self._connection()
            _set_synchronous(conn, any(j.is_durable for j in group))
            with _immediate_transaction(conn):
                for job in group:
                    outcomes.append(self._run_one(conn, job, is_alone=len(group) == 1))
                    if job.decided is not None:
                        _resolve_soon(job.loop, job.decided, *outcomes[-1])
        except BaseException as e:  # noqa: BLE001  (the group did not commit: none of it holds)
            outcomes = [(False, e)] * len(group)
            if self._held is not None and (self._held.invalidated or _is_stuck(self._held)):
                self._drop_connection()  # the next group starts on a fresh connection
        for job, (is_ok, value) in zip(group, outcomes, strict=True):
            if job.decided is not None:  # a no-op unless the group failed before the body had run
                _resolve_soon(job.loop, job.decided, is_ok, value)
            _resolve_soon(job.loop, job.future, is_ok, value)

    @staticmethod
    def _run_one(conn: Connection, job: _Job, is_alone: bool) -> tuple[bool, Any]:
        if is_alone:  # its error rolls the whole (one-body) transaction back
            return True, job.ctx.run(job.fn, conn, *job.args)
        try:
            with conn.begin_nested():
                return True, job.ctx.run(job.fn, conn, *job.args)
        except Exception as e:  # noqa: BLE001  (the body's own error; its savepoint is rolled back)
            if not conn.connection.dbapi_connection.in_transaction:
                # SQLite rolled the whole transaction back (disk full, I/O error): fail the group
                # rather than let later bodies run outside any transaction.
                raise
            return False, e


def _is_stuck(conn: Connection) -> bool:
    """A connection that is still inside a transaction after the group's rollback (it failed too)."""
    try:
        return bool(conn.connection.dbapi_connection.in_transaction)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001  (closed or broken: not worth keeping either)
        return True


def _set_synchronous(conn: Connection, is_durable: bool) -> None:
    """``FULL`` waits for the disk at commit; ``NORMAL`` (WAL) does not, and loses nothing on a crash of
    this process. Set outside the transaction, on the raw connection, before BEGIN."""
    level = "FULL" if is_durable else "NORMAL"
    if conn.connection.info.get("synchronous") != level:
        conn.connection.dbapi_connection.execute(f"PRAGMA synchronous={level}")
        conn.connection.info["synchronous"] = level


class SqliteReader:
    """Read-only transaction bodies on the calling thread, each in a ``BEGIN`` (deferred) transaction
    that is rolled back: one snapshot per body, and never a write lock.

    Two pools: an impatient one (``READER_BUSY_MS``) for the event loop, whose ``OperationalError`` the
    caller answers by retrying on the patient one (the usual busy timeout) in a worker thread. The event
    loop keeps its one connection checked out and begins and ends each snapshot on it directly: a pool
    checkout and SQLAlchemy's transaction bookkeeping cost three times the key lookup they wrap.
    """

    def __init__(self, url: URL) -> None:
        self._impatient = _reader_engine(url, READER_BUSY_MS, pool_size=1)
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
            if conn.in_transaction():  # fn ran SQLAlchemy's own execution, which began its bookkeeping
                conn.rollback()
            if raw.in_transaction:  # type: ignore[union-attr]
                raw.rollback()  # type: ignore[union-attr]

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
        self._impatient.dispose()
        self._patient.dispose()


def _reader_engine(url: URL, busy_timeout_ms: int, pool_size: int) -> Engine:
    engine = create_engine(url.set(drivername="sqlite"), pool_size=pool_size, max_overflow=8)
    event.listen(engine, "connect", lambda c, r: _connect(c, r, busy_timeout_ms))
    event.listen(engine, "begin", _begin_deferred)
    return engine
