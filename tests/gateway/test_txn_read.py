"""``TxnRunner.read``: read-only bodies, on the event loop's thread for SQLite, never blocking it for long."""

import asyncio
import sqlite3
import threading
import time

import pytest
from sqlalchemy import select

from audit.prepared import execute
from gateway.storage.db import make_db_engine
from gateway.storage.models import AdminToken
from gateway.storage.txn import TxnRunner

from .conftest import add_token

_TOKENS = AdminToken.__table__


def _ids(conn):
    return sorted(conn.execute(select(_TOKENS.c.id)).scalars())


_SELECT_IDS = select(_TOKENS.c.id).order_by(_TOKENS.c.id)


def _ids_direct(conn):
    """The same read through ``audit.prepared`` (the raw cursor: its errors are sqlite3's own)."""
    return [token_id for (token_id,) in execute(conn, _SELECT_IDS)]


def _write_and_return(conn):
    add_token(conn, "from-a-read")
    return _ids(conn)


async def test_read_sees_commits_and_never_keeps_a_write(db_url):
    db = make_db_engine(db_url, null_pool=True)
    runner = TxnRunner(db)
    try:
        await runner.run(add_token, "committed")
        assert await runner.read(_ids) == ["committed"]
        # A body that writes anyway sees its own write, and the read transaction then rolls it back.
        assert await runner.read(_write_and_return) == ["committed", "from-a-read"]
        assert await runner.read(_ids) == ["committed"]
        await runner.run(add_token, "next")  # the writer was never blocked by the reads
        assert await runner.read(_ids) == ["committed", "next"]
        assert await runner.read(_ids_direct) == ["committed", "next"]
    finally:
        await runner.close()
        await db.dispose()


@pytest.mark.parametrize("read_ids", [_ids, _ids_direct])
async def test_read_waits_for_a_locked_database_off_the_event_loop(sqlite_url, read_ids):
    """Another process holding SQLite's exclusive lock makes readers wait: the loop's own read gives up
    after LOOP_BUSY_MS and the read goes on in a worker thread, so other tasks keep running."""
    path = sqlite_url.split(":///", 1)[1]
    locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")  # before this test opens any connection of its own
    locker.execute("INSERT INTO admin_tokens (id, name, secret_hash, created_at, scopes) "
                   "VALUES ('locked', '', '', '2026-01-01 00:00:00', '')")
    db = make_db_engine(sqlite_url, null_pool=True)
    runner = TxnRunner(db)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    def release_later():
        time.sleep(0.4)
        locker.execute("COMMIT")
        locker.execute("PRAGMA locking_mode=NORMAL")
        locker.execute("SELECT 1 FROM admin_tokens").fetchall()  # drops the exclusive lock
        locker.close()

    tick_task = asyncio.create_task(ticker())
    threading.Thread(target=release_later).start()
    try:
        t0 = time.perf_counter()
        assert await runner.read(read_ids) == ["locked"]
        assert time.perf_counter() - t0 >= 0.3  # it did wait for the lock ...
        assert ticks >= 10  # ... and the event loop kept running meanwhile
    finally:
        tick_task.cancel()
        await runner.close()
        await db.dispose()


async def test_read_retries_a_driver_busy_error_in_a_worker_thread(sqlite_url):
    """Bodies on the raw cursor raise sqlite3's own OperationalError, not SQLAlchemy's wrapper: the
    impatient read must hand those to the patient pool too."""
    db = make_db_engine(sqlite_url, null_pool=True)
    runner = TxnRunner(db)
    on_loop_thread = []

    def flaky(conn):
        on_loop_thread.append(threading.current_thread() is threading.main_thread())
        if len(on_loop_thread) == 1:
            raise sqlite3.OperationalError("database is locked")
        return _ids_direct(conn)

    try:
        await runner.run(add_token, "committed")
        assert await runner.read(flaky) == ["committed"]
        assert on_loop_thread == [True, False]
        assert await runner.read(_ids_direct) == ["committed"]  # the held connection is still usable
    finally:
        await runner.close()
        await db.dispose()
