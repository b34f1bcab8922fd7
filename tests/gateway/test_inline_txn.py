"""Inline transaction bodies (SQLite): run on the caller's thread while the writer is idle, committed by
the writer thread, in the same order as queued bodies, and never blocking the event loop on a lock."""

import asyncio
import sqlite3
import threading
import time

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from gateway.storage.models import AdminToken

from .conftest import add_token, open_runner, token_ids
from .test_early_commit import _add_then_break, _break_commit_raw

_TOKENS = AdminToken.__table__


def _add_on(conn, token_id, delay_s=0.0):
    """``add_token`` that reports the thread the body ran on."""
    add_token(conn, token_id, delay_s)
    return threading.current_thread().name


def _fail(conn, token_id):
    add_token(conn, token_id)
    raise ValueError(token_id)


def _sees(conn, token_id):
    return conn.execute(select(_TOKENS.c.id).where(_TOKENS.c.id == token_id)).first() is not None


async def test_an_inline_body_runs_here_and_its_commit_on_the_writer(sqlite_url):
    async with open_runner(sqlite_url) as (db, runner):
        here = threading.current_thread().name
        assert await runner.run(_add_on, "inline", inline=True) == here
        assert await runner.run(_add_on, "queued") == "kvgate-sqlite-writer"
        result, committed = await runner.run_early(_add_on, "early", inline=True)
        assert result == here and await committed == here
        with pytest.raises(ValueError):
            await runner.run(_fail, "rolled-back", inline=True)
        with pytest.raises(ValueError):
            await runner.run_early(_fail, "rolled-back-early", inline=True)
        assert await runner.run(_add_on, "after", inline=True) == here  # the connection was given back
        assert await token_ids(db) == {"inline", "queued", "early", "after"}


async def test_an_inline_body_waits_its_turn_behind_queued_work(sqlite_url):
    async with open_runner(sqlite_url) as (db, runner):
        busy = asyncio.ensure_future(runner.run(_add_on, "first", 0.3))
        await asyncio.sleep(0.1)  # the writer is inside "first"
        assert await runner.run(_add_on, "second", inline=True) == "kvgate-sqlite-writer"
        assert await busy == "kvgate-sqlite-writer"
        # Queued while an inline body's commit is pending, a body runs after that commit, in a transaction
        # of its own: it never sees the rows of an inline body whose commit then fails.
        result, committed = await runner.run_early(_add_then_break, "lost", inline=True)
        assert result == "lost"
        assert await runner.run(_sees, "lost") is False
        with pytest.raises(IntegrityError):
            await committed
        assert await token_ids(db) == {"first", "second"}


async def test_a_body_queued_from_another_thread_during_an_inline_body_runs_after_its_commit(sqlite_url):
    async with open_runner(sqlite_url) as (db, runner):
        seen: dict[str, object] = {}

        def other_thread() -> None:  # another event loop of the process, queueing while the body runs
            seen["other"] = asyncio.run(runner.run(_sees, "inline"))

        def body(conn):
            add_token(conn, "inline")
            thread = threading.Thread(target=other_thread)
            thread.start()
            time.sleep(0.2)  # its body is queued now, ahead of this one's commit
            seen["thread"] = thread
            return "inline"

        assert await asyncio.wait_for(runner.run(body, inline=True), 10) == "inline"
        await asyncio.to_thread(seen["thread"].join, 10)
        assert seen["other"] is True  # it ran after the inline commit, not inside the open transaction
        assert await token_ids(db) == {"inline"}


async def test_an_inline_body_never_waits_on_the_event_loop_for_another_process(sqlite_url):
    path = sqlite_url.split("///", 1)[1]
    other = sqlite3.connect(path, isolation_level=None)  # another process's writer
    other.execute("BEGIN IMMEDIATE")
    try:
        async with open_runner(sqlite_url) as (db, runner):
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.ensure_future(tick())
            call = asyncio.ensure_future(runner.run(_add_on, "waited", inline=True))
            await asyncio.sleep(0.5)
            assert not call.done() and ticks >= 20  # the loop kept running while the lock was held
            other.execute("COMMIT")
            assert await asyncio.wait_for(call, 10) == "kvgate-sqlite-writer"  # handed to the writer
            ticker.cancel()
            assert await runner.run(_add_on, "next", inline=True) == threading.current_thread().name
            assert await token_ids(db) == {"waited", "next"}
    finally:
        other.close()


@pytest.mark.parametrize("body", [_add_then_break, _break_commit_raw])
async def test_a_failed_inline_commit_is_reported_and_the_writer_recovers(sqlite_url, body):
    async with open_runner(sqlite_url) as (db, runner):
        error = IntegrityError if body is _add_then_break else sqlite3.IntegrityError
        result, committed = await runner.run_early(body, "lost", inline=True)
        assert result == "lost"
        with pytest.raises(error):
            await committed
        with pytest.raises(error):
            await runner.run(body, "lost-again", inline=True)
        assert await runner.run(_add_on, "after", inline=True) == threading.current_thread().name
        assert await runner.run(_add_on, "queued") == "kvgate-sqlite-writer"
        assert await token_ids(db) == {"after", "queued"}
