"""Admission decides before its commit is durable: the engine starts during the disk flush, nothing is
shown before the commit, and a commit that fails takes the whole request with it."""

import asyncio
import sqlite3
import time

import pytest
from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError

from gateway.storage.models import ApiKey
from policies import Policy

from .conftest import add_token, open_gateway, open_runner, tenant_events, token_ids


def _break_commit(conn):
    """Queue a foreign-key violation that SQLite checks only at COMMIT, so the body itself succeeds."""
    from gateway.clock import utcnow

    conn.exec_driver_sql("PRAGMA defer_foreign_keys=ON")
    conn.execute(insert(ApiKey.__table__).values(
        id="orphan", tenant_id="no-such-tenant", name="", secret_hash="0" * 64, created_at=utcnow()))


def _add_then_break(conn, token_id):
    add_token(conn, token_id)
    _break_commit(conn)
    return token_id


def _fail(conn):
    raise ValueError("boom")


async def test_run_early_gives_the_result_then_the_commit(db_url):
    async with open_runner(db_url) as (db, runner):
        result, committed = await runner.run_early(add_token, "early")
        assert result == "early" and await committed == "early"
        assert await token_ids(db) == {"early"}
        with pytest.raises(ValueError):  # the body's own error comes from run_early itself
            await runner.run_early(_fail)


async def test_run_early_returns_while_its_group_still_runs_and_reports_a_failed_commit(sqlite_url):
    async with open_runner(sqlite_url) as (db, runner):
        busy = asyncio.ensure_future(runner.run(add_token, "first", 0.3))
        await asyncio.sleep(0.1)  # the writer is inside "first": the next two queue into one group
        early = asyncio.ensure_future(runner.run_early(add_token, "early"))
        slow = asyncio.ensure_future(runner.run(add_token, "slow", 0.5))
        result, committed = await early
        assert result == "early" and not committed.done()  # decided; "slow" still holds the group open
        assert await committed == "early" and await slow == "slow"
        await busy

        result, committed = await runner.run_early(_add_then_break, "lost")
        assert result == "lost"  # the body ran...
        with pytest.raises(IntegrityError):
            await committed  # ...but its commit failed, and nothing of it holds
        assert await token_ids(db) == {"first", "early", "slow"}


def _chat(gw, key, max_tokens=2):
    body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens}
    return gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body)


async def test_a_failed_admission_commit_fails_the_request_and_leaks_nothing(tmp_path, sqlite_url, llm,
                                                                             monkeypatch):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(max_concurrent_requests=1))
        store = gw.runtime.audit_store
        append = store.append_many_sync

        def append_then_break(conn, events, append=append):
            head = append(conn, events)
            if any(e.name == "request.admitted" for e in events):
                _break_commit(conn)
            return head

        for stream in (False, True):
            with monkeypatch.context() as m:
                m.setattr(store, "append_many_sync", append_then_break)
                body = {"model": gw.runtime.engine.model_name, "max_tokens": 8, "stream": stream,
                        "messages": [{"role": "user", "content": "hello"}]}
                r = await gw.client.post("/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "data:" not in r.text  # not one token was shown
        deadline = time.monotonic() + 10  # the engine drops the aborted requests on its next turn
        while gw.runtime.engine.stats().num_kv_blocks_used and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert gw.runtime.engine.stats().num_kv_blocks_used == 0
        usage = await gw.client.get(f"/admin/v1/tenants/{tid}/usage?window=minute", headers=gw.admin())
        assert usage.json() == []  # neither reserved nor settled
        ok = await _chat(gw, key)  # the one concurrency slot was never held
        assert ok.status_code == 200, ok.text
        names = [name for name, _, _ in await tenant_events(sqlite_url, tmp_path, tid)]
        # The failed requests' auth.success is still recorded (on its own, after the commit failed).
        assert names == ["auth.success", "auth.success",
                         "auth.success", "request.admitted", "request.finished"]


def _break_commit_raw(conn, token_id):
    """As ``_add_then_break``, on the DBAPI cursor only (SQLAlchemy never learns of the transaction)."""
    raw = conn.connection.dbapi_connection
    raw.execute("INSERT INTO admin_tokens (id, name, secret_hash, created_at, scopes) "
                "VALUES (?, '', '', '2026-01-01 00:00:00', '')", (token_id,))
    raw.execute("PRAGMA defer_foreign_keys=ON")
    raw.execute("INSERT INTO api_keys (id, tenant_id, name, secret_hash, created_at) "
                "VALUES ('orphan', 'no-such-tenant', '', '', '2026-01-01 00:00:00')")
    return token_id


@pytest.mark.parametrize("body", [_add_then_break, _break_commit_raw])
async def test_the_writer_recovers_from_a_failed_commit(sqlite_url, body):
    async with open_runner(sqlite_url) as (db, runner):
        with pytest.raises(IntegrityError if body is _add_then_break else sqlite3.IntegrityError):
            await runner.run(body, "lost")
        assert await runner.run(add_token, "after") == "after"  # the writer's connection is usable
        assert await token_ids(db) == {"after"}
