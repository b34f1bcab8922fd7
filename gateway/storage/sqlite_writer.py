"""SQLite group commit: one writer thread runs queued transaction bodies together, one commit per group;
a short body may run on its caller's thread while the writer is idle, leaving the writer its commit."""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, create_engine, event
from sqlalchemy.engine import URL

from gateway.storage.db import BUSY_TIMEOUT_MS
from gateway.storage.sqlite_conn import (
    begin_immediate,
    commit,
    connect_sqlite,
    immediate_transaction,
    is_stuck,
    rollback,
    set_pragmas,
)

MAX_GROUP = 64
# How long a body on the event loop's thread waits for SQLite's lock (another process writing) before
# the work is handed to a thread that waits the full busy timeout instead.
LOOP_BUSY_MS = 20


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


@dataclass(slots=True)
class _InlineEnd:
    """The writer thread's cue that a body run on its caller's thread has ended: commit its transaction
    and resolve ``future`` with ``value``; without a future there is nothing to commit (it never began,
    or its caller rolled it back), and the writer just takes its connection back."""

    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None
    value: Any = None


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

    ``inline`` bodies skip the two thread hand-offs when nothing is queued or running: the caller's
    thread begins the transaction and runs the body, and only the commit (the wait for the disk) goes
    to the writer thread. Bodies queued meanwhile wait for that commit, so the order is the same.
    """

    def __init__(self, url: URL) -> None:
        self._engine = create_engine(url.set(drivername="sqlite"), pool_size=1, max_overflow=0)
        event.listen(self._engine, "connect", connect_sqlite)
        event.listen(self._engine, "begin", begin_immediate)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._held: Connection | None = None  # kept checked out between groups
        self._lock = threading.Lock()
        self._num_outstanding = 0  # queued or running bodies, an inline one until its commit is done
        self._is_inline_open = False  # a caller runs a body on the held connection, or it waits to commit
        self._thread = threading.Thread(target=self._run, name="kvgate-sqlite-writer", daemon=True)
        self._thread.start()

    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        is_durable: bool,
        decided: asyncio.Future | None = None,
        *,
        inline: bool = False,
    ) -> asyncio.Future:
        """Queue ``fn(conn, *args)``; the future resolves once its group has committed (or failed).

        ``decided``, if given, resolves as soon as the body has run, before the commit (which may still fail).
        ``inline``: run the body here and now if the writer is idle; only for a few indexed statements,
        as the event loop waits for it.
        """
        loop = asyncio.get_running_loop()
        if inline and self._may_begin_inline(is_durable):
            return self._run_inline(fn, args, loop, decided)
        # The context (request ids, redaction hints) goes with the body to the writer thread.
        job = _Job(fn, args, is_durable, contextvars.copy_context(), loop, loop.create_future(), decided)
        with self._lock:
            self._num_outstanding += 1
        self._jobs.put(job)
        return job.future

    def _may_begin_inline(self, is_durable: bool) -> bool:
        with self._lock:
            if self._num_outstanding:
                return False
            self._num_outstanding, self._is_inline_open = 1, True
        try:
            conn = self._connection()
            set_pragmas(conn, is_durable, LOOP_BUSY_MS)
            conn.connection.dbapi_connection.execute("BEGIN IMMEDIATE")  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001  (another process writes, or the connection broke: queue it)
            self._jobs.put(_InlineEnd())
            return False
        return True

    def _run_inline(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        decided: asyncio.Future | None,
    ) -> asyncio.Future:
        conn, future = self._held, loop.create_future()
        assert conn is not None
        try:
            value = contextvars.copy_context().run(fn, conn, *args)
        except BaseException as e:
            with suppress(Exception):  # a connection that stays in its transaction is dropped by the writer
                rollback(conn)
            self._jobs.put(_InlineEnd())
            if not isinstance(e, Exception):
                raise
            for pending in (decided, future):
                if pending is not None:
                    resolve(pending, False, e)
            return future
        if decided is not None:
            resolve(decided, True, value)
        self._jobs.put(_InlineEnd(loop, future, value))
        return future

    def close(self) -> None:
        """Finish the queued bodies and stop (blocking)."""
        self._jobs.put(None)
        self._thread.join()
        self._engine.dispose()

    def _run(self) -> None:
        is_stopping = False
        while not is_stopping:
            group, is_stopping = self._next_group()
            if group:
                self._run_group(group)
        self._drop_connection()

    def _next_group(self) -> tuple[list[_Job], bool]:
        """The queued bodies to run together, and whether to stop after them. An inline body's commit
        is done on the way: bodies queued while it ran come before its end in the queue, but after it."""
        group: list[_Job] = []
        item = self._jobs.get()
        while True:
            if item is None:
                return group, True
            if isinstance(item, _InlineEnd):
                self._end_inline(item)
            else:
                group.append(item)
            with self._lock:
                is_inline_open = self._is_inline_open
            if is_inline_open:  # its end is on the way: nothing may begin before it
                item = self._jobs.get()
                continue
            if len(group) >= MAX_GROUP:
                return group, False
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return group, False

    def _end_inline(self, end: _InlineEnd) -> None:
        is_ok, value = True, end.value
        if end.future is not None and self._held is not None:
            try:
                commit(self._held)
            except BaseException as e:  # noqa: BLE001  (reported to the caller)
                is_ok, value = False, e
                with suppress(Exception):
                    rollback(self._held)
        self._maybe_drop_connection()
        with self._lock:
            self._num_outstanding, self._is_inline_open = self._num_outstanding - 1, False
        if end.future is not None and end.loop is not None:
            _resolve_soon(end.loop, end.future, is_ok, value)

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

    def _maybe_drop_connection(self) -> None:
        if self._held is not None and (self._held.invalidated or is_stuck(self._held)):
            self._drop_connection()  # the next transaction starts on a fresh connection

    def _run_group(self, group: list[_Job]) -> None:
        outcomes: list[tuple[bool, Any]] = []
        try:
            conn = self._connection()
            set_pragmas(conn, any(j.is_durable for j in group), BUSY_TIMEOUT_MS)
            with immediate_transaction(conn):
                for job in group:
                    outcomes.append(self._run_one(conn, job, is_alone=len(group) == 1))
                    if job.decided is not None:
                        _resolve_soon(job.loop, job.decided, *outcomes[-1])
        except BaseException as e:  # noqa: BLE001  (the group did not commit: none of it holds)
            outcomes = [(False, e)] * len(group)
            self._maybe_drop_connection()
        with self._lock:  # before the callers hear of it: the connection is free for an inline body
            self._num_outstanding -= len(group)
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
