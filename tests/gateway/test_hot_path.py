"""The request hot path: one-transaction runner, audit events inside the work's own transaction."""

import asyncio
import time

import pytest
from sqlalchemy import delete

from gateway.storage.db import make_db_engine
from gateway.storage.models import AdminToken
from gateway.storage.txn import TxnRunner
from policies import Policy

from .conftest import add_token, open_gateway, open_runner, tenant_events, token_ids

_TOKENS = AdminToken.__table__


def _drop_token(conn, token_id):
    conn.execute(delete(_TOKENS).where(_TOKENS.c.id == token_id))


def _sync_level(conn):
    if conn.dialect.name == "sqlite":
        return {1: "off-disk", 2: "on-disk"}[conn.exec_driver_sql("PRAGMA synchronous").scalar()]
    return {"off": "off-disk", "on": "on-disk"}[conn.exec_driver_sql("SHOW synchronous_commit").scalar()]


async def test_runner_commits_rolls_back_and_sets_durability(db_url):
    db = make_db_engine(db_url, null_pool=True)
    runner, relaxed = TxnRunner(db), TxnRunner(db, is_durable=False)  # KVGATE_DURABLE_COMMITS=false

    def fail(conn):
        add_token(conn, "rolled-back")
        raise ValueError("boom")

    try:
        assert await runner.run(add_token, "committed") == "committed"
        with pytest.raises(ValueError):
            await runner.run(fail)
        assert await token_ids(db) == {"committed"}
        assert await runner.run(_sync_level) == "on-disk"
        assert await runner.run(_sync_level, durable=False) == "off-disk"
        assert await runner.run(_sync_level) == "on-disk"
        assert await relaxed.run(_sync_level) == "off-disk"
    finally:
        await runner.close()
        await relaxed.close()
        await db.dispose()


async def test_runner_undoes_a_commit_its_cancelled_caller_never_saw(sqlite_url):
    async with open_runner(sqlite_url) as (db, runner):
        for token_id, undo in (("undone", _drop_token), ("kept", None)):
            call = asyncio.ensure_future(runner.run(add_token, token_id, 0.3, undo=undo))
            await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        deadline = time.monotonic() + 10  # both bodies finish in the writer thread; then the undo runs
        while await token_ids(db) != {"kept"} and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await token_ids(db) == {"kept"}


async def test_writer_groups_queued_bodies_and_isolates_a_failing_one(sqlite_url):
    async with open_runner(sqlite_url) as (db, runner):

        def add(conn, token_id, should_fail=False):
            add_token(conn, token_id)
            if should_fail:
                raise ValueError(token_id)
            return conn.get_transaction()  # the object itself, so its id cannot be reused

        busy = asyncio.ensure_future(runner.run(add_token, "first", 0.3))
        await asyncio.sleep(0.1)  # the writer is inside "first": the next three queue into one group
        grouped = await asyncio.gather(
            runner.run(add, "a"), runner.run(add, "b", True), runner.run(add, "c"), return_exceptions=True
        )
        await busy
        assert isinstance(grouped[1], ValueError)
        assert grouped[0] is grouped[2]  # one transaction, one commit
        assert await token_ids(db) == {"first", "a", "c"}  # b's savepoint alone was rolled back


def _chat(gw, key, content="hi"):
    body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2}
    return gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body)


async def _minute_usage(gw, tenant_id):
    r = await gw.client.get(f"/admin/v1/tenants/{tenant_id}/usage?window=minute", headers=gw.admin())
    return r.json()


def _fail_store_on(gw, monkeypatch, event_name, when="append"):
    """Make the audit store raise for ``event_name``: while appending it inside the caller's transaction,
    or (``when="prepare"``) already while building it, before any transaction."""
    import audit.sink

    store, to_event = gw.runtime.audit_store, audit.sink._to_event
    append = store.append_many_sync

    def flaky_append(conn, events):
        if any(e.name == event_name for e in events):
            raise RuntimeError("audit store down")
        return append(conn, events)

    def flaky_prepare(name, fields):
        if name == event_name:
            raise RuntimeError("audit store down")
        return to_event(name, fields)

    if when == "append":
        monkeypatch.setattr(store, "append_many_sync", flaky_append)
    else:
        monkeypatch.setattr(audit.sink, "_to_event", flaky_prepare)


@pytest.fixture
async def one_slot(tmp_path, db_url, llm):
    """A gateway and a tenant allowed one request at a time: a leaked slot fails its next request."""
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(max_concurrent_requests=1))
        yield gw, tid, key


async def test_admission_audit_failure_rolls_back_the_reservation(one_slot, monkeypatch):
    gw, tid, key = one_slot
    with monkeypatch.context() as m:
        _fail_store_on(gw, m, "request.admitted")
        r = await _chat(gw, key)
        assert r.status_code == 503 and r.json()["error"]["code"] == "audit_unavailable"
        assert await _minute_usage(gw, tid) == []  # nothing reserved, not even the window rows
    r = await _chat(gw, key)  # the concurrency slot was never taken
    assert r.status_code == 200, r.text
    rows = await _minute_usage(gw, tid)
    assert rows[0]["num_requests"] == 1 and rows[0]["total_tokens"] == r.json()["usage"]["total_tokens"]


@pytest.mark.parametrize("when", ["append", "prepare"])
async def test_finish_audit_failure_still_settles(one_slot, monkeypatch, when):
    gw, tid, key = one_slot
    with monkeypatch.context() as m:
        _fail_store_on(gw, m, "request.finished", when)
        first = await _chat(gw, key)
    assert first.status_code == 200
    second = await _chat(gw, key)  # the slot was released although request.finished was lost
    assert second.status_code == 200
    used = sum(r.json()["usage"]["total_tokens"] for r in (first, second))
    # summed over the minute rows: the two requests may fall on either side of a minute's end
    assert sum(row["total_tokens"] for row in await _minute_usage(gw, tid)) == used


async def test_one_request_chains_its_events_in_order(tmp_path, db_url, llm):
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant()
        assert (await _chat(gw, key)).status_code == 200
        rows = await tenant_events(db_url, tmp_path, tid)
        assert [name for name, _, _ in rows] == ["auth.success", "request.admitted", "request.finished"]
        assert rows[1][1] is not None and rows[1][1] == rows[2][1]


async def test_policy_change_applies_on_the_next_request(tmp_path, db_url, llm):
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant()
        assert (await _chat(gw, key)).status_code == 200
        r = await gw.client.put(f"/admin/v1/tenants/{tid}/policy", headers=gw.admin(),
                                json={"policy": {"requests_per_minute": 1}})
        assert r.status_code == 200, r.text
        limited = await _chat(gw, key)
        assert limited.status_code == 429 and limited.headers["x-ratelimit-limit-requests"] == "1"


async def test_a_failure_after_the_decision_leaks_no_slot_or_engine_place(one_slot, monkeypatch):
    """What the admission computes from the decision (the tenant's engine share, read from the engine's
    stats, say) fails before the reservation is written, never between it and its settlement."""
    import gateway.inference.admission as admission

    gw, tid, key = one_slot
    with monkeypatch.context() as m:
        def broken_share(*_):
            raise RuntimeError("engine stats unavailable")

        m.setattr(admission, "_share", broken_share)
        r = await _chat(gw, key)
        assert r.status_code == 500  # the server's own fault, answered as such
    assert gw.runtime.overload.num_places(tid) == (0, 0)
    assert await _minute_usage(gw, tid) == []  # nothing was reserved
    r = await _chat(gw, key)  # the tenant's one concurrency slot is free
    assert r.status_code == 200, r.text
