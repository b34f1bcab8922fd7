"""Whole transactions as one synchronous body: SQLite on a single writer thread, PostgreSQL via run_sync."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.storage.sqlite_reader import SqliteReader
from gateway.storage.sqlite_writer import SqliteWriter, resolve

T = TypeVar("T")
TxnBody = Callable[..., T]  # fn(conn: Connection, *args) -> T


class TxnRunner:
    """Runs ``fn(conn, *args)`` inside one transaction that commits when it returns and rolls back when
    it raises.

    SQLite: ``SqliteWriter``, one thread with a synchronous engine that runs the whole body. Through
    aiosqlite every statement costs three or four thread round trips (cursor, execute, fetch, close);
    here a transaction is one, this process's writers queue instead of polling SQLite's busy timeout,
    and bodies queued together share one commit. PostgreSQL (and in-memory SQLite, which a second
    engine could not see): the async engine's own connection through ``run_sync``, one network round
    trip per statement and no thread; the server itself groups concurrent commits.
    """

    def __init__(self, db: AsyncEngine, *, is_durable: bool = True) -> None:
        """``is_durable=False`` makes every commit a non-durable one (see ``run``)."""
        self.dialect = db.dialect.name
        self.is_durable = is_durable
        self._db = db
        self._writer: SqliteWriter | None = None
        self._reader: SqliteReader | None = None
        self._undoing: set[asyncio.Future] = set()
        if self.dialect == "sqlite" and (db.url.database or "") not in ("", ":memory:"):
            self._writer = SqliteWriter(db.url)
            self._reader = SqliteReader(db.url)

    @property
    def is_ordered(self) -> bool:
        """Whether this process's transactions run one after another in the order they were started
        (SQLite's writer thread): one started before another has committed before the other begins."""
        return self._writer is not None

    async def read(self, fn: TxnBody[T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` in a read-only transaction (rolled back, so it must not write).

        SQLite: on this thread, on a connection of its own. In WAL mode a read never waits for a
        writer, and a short lookup (a key by primary key) costs less than handing it to any thread; if
        SQLite does make it wait (a checkpoint or recovery in another process), it is retried in a
        worker thread with the full busy timeout, so the event loop is never held for long.
        PostgreSQL and in-memory SQLite: the async engine, as ``run`` does.
        """
        if self._reader is None:
            async with self._db.connect() as conn:
                return await conn.run_sync(fn, *args)
        try:
            return self._reader.run(fn, args, is_patient=False)
        except (OperationalError, sqlite3.OperationalError):  # the latter from ``audit.prepared`` bodies
            return await asyncio.to_thread(self._reader.run, fn, args, is_patient=True)

    async def run(
        self,
        fn: TxnBody[T],
        *args: Any,
        durable: bool = True,
        undo: TxnBody[Any] | None = None,
        inline: bool = False,
    ) -> T:
        """Run ``fn`` in a transaction and return its result.

        Args:
            fn: ``fn(conn, *args)``, synchronous; it must not await or block on anything but the database.
            args: Passed after the connection.
            durable: Flush the commit to disk before returning. ``False`` commits without waiting for the
                flush (SQLite ``synchronous=NORMAL`` in WAL mode, PostgreSQL ``synchronous_commit=off``):
                a crash of this process loses nothing, an OS crash may lose this transaction, but never
                it alone while keeping a later durable one, as both databases flush their log in order.
            undo: ``undo(conn, result)``, run in a new transaction when the caller is cancelled while
                ``fn`` is running and ``fn`` then commits anyway (so a reservation cannot leak).
            inline: SQLite: run ``fn`` on this thread, before returning to the event loop, when no
                other transaction of this process is queued or running, and leave only the commit to
                the writer thread (two thread hand-offs fewer). For bodies of a few indexed statements.
        """
        pending = self._start(fn, args, durable and self.is_durable, inline=inline)
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            if undo is not None:
                pending.add_done_callback(lambda f: self._maybe_undo(f, undo))
            raise

    async def run_early(
        self,
        fn: TxnBody[T],
        *args: Any,
        durable: bool = True,
        undo: TxnBody[Any] | None = None,
        inline: bool = False,
    ) -> tuple[T, asyncio.Future]:
        """Like ``run``, but return as soon as ``fn`` has run, before the commit, with the commit's future.

        The future resolves with ``fn``'s result once the commit is done (durable when asked), or with
        the error that stopped it (the transaction is then rolled back). This lets a caller overlap the
        commit's wait for the disk with work of its own, which it must keep to itself until the commit
        is done, and undo if it fails. Errors of ``fn`` itself are raised here, as ``run`` raises them.
        """
        decided = asyncio.get_running_loop().create_future()
        pending = self._start(fn, args, durable and self.is_durable, decided, inline=inline)
        pending.add_done_callback(_consume)  # the caller may never look at a failed commit's error
        try:
            return await asyncio.shield(decided), pending
        except asyncio.CancelledError:
            if undo is not None:
                pending.add_done_callback(lambda f: self._maybe_undo(f, undo))
            raise

    def _start(
        self,
        fn: TxnBody[T],
        args: tuple[Any, ...],
        durable: bool,
        decided: asyncio.Future | None = None,
        *,
        inline: bool = False,
    ) -> asyncio.Future:
        if self._writer is not None:
            return self._writer.submit(fn, args, durable, decided, inline=inline)
        return asyncio.ensure_future(self._run_async(fn, args, durable, decided))

    async def _run_async(
        self, fn: TxnBody[T], args: tuple[Any, ...], durable: bool, decided: asyncio.Future | None = None
    ) -> T:
        try:
            async with self._db.begin() as conn:
                if not durable and self.dialect == "postgresql":
                    await conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
                result = await conn.run_sync(fn, *args)
                if decided is not None:
                    resolve(decided, True, result)
        except BaseException as e:
            if decided is not None:
                resolve(decided, False, e)
            raise
        return result

    def _maybe_undo(self, done: asyncio.Future, undo: TxnBody[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            pending = asyncio.ensure_future(self.run(undo, done.result()))
            self._undoing.add(pending)
            pending.add_done_callback(self._undoing.discard)

    async def close(self) -> None:
        if self._writer is not None:
            await asyncio.to_thread(self._writer.close)
            self._writer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _consume(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()
