"""Failed authentications are counted per peer address: past the limit a peer gets 429s without its key
being looked up, and the failures are audited in batches whose counts add up to every failure."""

import asyncio
import json
import time

import pytest

from gateway.audit_hook import AuditHook
from gateway.limits.auth_failures import OTHER_PEERS, AuthFailureLimits, AuthFailures

from .asgi_calls import call_app, on_app_loop
from .conftest import open_gateway

BAD_KEY = "kvg_0123456789abcdef_" + "x" * 43
LIMIT, FLUSH_S = 5, 2.0


async def _failure_events(db_url, data_dir):
    """The data of every ``auth.failure`` event in the audit store (whose chain must verify)."""
    from sqlalchemy import select

    from audit.integrity import verify_store
    from audit.keys import load_or_create_keys
    from audit.store import AuditStore
    from audit.tables import audit_events
    from gateway.storage.db import make_db_engine

    store = AuditStore(make_db_engine(db_url, null_pool=True), load_or_create_keys(data_dir))
    try:
        async with store.engine.connect() as conn:
            rows = (await conn.execute(
                select(audit_events.c.data).where(audit_events.c.name == "auth.failure")
                .order_by(audit_events.c.seq)
            )).scalars().all()
        assert (await verify_store(store)).ok
    finally:
        await store.engine.dispose()
    return [json.loads(data) for data in rows]


def _counts(events):
    out: dict[tuple[str, str], int] = {}
    for e in events:
        out[(e["peer"], e["reason"])] = out.get((e["peer"], e["reason"]), 0) + e["num_failures"]
    return out


def _count_key_lookups(gw, monkeypatch):
    txn, seen = gw.runtime.txn, []
    read = txn.read

    async def counting_read(fn, *args):
        seen.append(fn.__name__)
        return await read(fn, *args)

    monkeypatch.setattr(txn, "read", counting_read)
    return seen


async def _burst(gw, num_requests):
    """``num_requests`` bad keys from the test client's peer; returns the responses and the seconds taken."""
    start = time.monotonic()
    responses = [await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {BAD_KEY}"})
                 for _ in range(num_requests)]
    return responses, time.monotonic() - start


async def test_a_burst_of_bad_keys_is_throttled_and_audited_in_batches(tmp_path, db_url, llm, monkeypatch):
    num_requests = 40
    limits = {"auth_failure_limit": LIMIT, "auth_failure_flush_s": FLUSH_S}
    async for gw in open_gateway(tmp_path, db_url, llm, **limits):
        _, key = await gw.make_tenant()
        lookups = _count_key_lookups(gw, monkeypatch)
        responses, elapsed = await _burst(gw, num_requests)
        assert [r.status_code for r in responses] == [401] * LIMIT + [429] * (num_requests - LIMIT)
        assert len(lookups) == LIMIT  # the throttled requests never reached the database
        throttled = responses[-1].json()["error"]
        assert throttled["type"] == "rate_limit_error" and throttled["code"] == "too_many_auth_failures"
        assert 1 <= int(responses[-1].headers["retry-after"]) <= 60
        # The same peer is refused with a good key too; another peer is not.
        r = await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 429
        other = await on_app_loop(gw, call_app, gw.client.app, key, None, "/v1/models", None, None,
                                  ("10.0.0.2", 40000))
        assert other.status == 200, other.body
        assert len(lookups) == LIMIT + 1
    events = await _failure_events(db_url, tmp_path)  # the last batch was written at shutdown
    assert _counts(events) == {("testclient", "invalid_api_key"): LIMIT,
                               ("testclient", "too_many_auth_failures"): num_requests + 1 - LIMIT}
    # One write per flush interval at most, each with an event per reason: far fewer than requests.
    assert len(events) <= 2 * (elapsed / FLUSH_S + 2) and len(events) < num_requests / 4
    assert {e["path"] for e in events} == {"/v1/models"}


async def test_failures_are_flushed_in_the_background(tmp_path, sqlite_url, llm):
    limits = {"auth_failure_limit": LIMIT, "auth_failure_flush_s": 0.2}
    async for gw in open_gateway(tmp_path, sqlite_url, llm, **limits):
        await _burst(gw, 12)
        deadline = time.monotonic() + 30
        while sum(_counts(await _failure_events(sqlite_url, tmp_path)).values()) < 12:
            assert time.monotonic() < deadline, "the background flush never came"
            await asyncio.sleep(0.1)
    assert sum(_counts(await _failure_events(sqlite_url, tmp_path)).values()) == 12  # nothing twice


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


async def test_the_peer_table_is_bounded_and_keeps_every_count():
    events, kept = [], set()
    clock = _Clock()
    limits = AuthFailureLimits(limit=2, window_s=60.0, flush_s=1.0, max_peers=3)
    hook = AuditHook(lambda name, fields: events.append(dict(fields)))
    failures = AuthFailures(hook, None, kept.add, limits, clock)
    for i in range(10):
        await failures.record(f"10.0.0.{i}", "invalid_api_key", "/v1/models", may_write=False)
        await failures.record(f"10.0.0.{i}", "invalid_api_key", "/v1/models", may_write=False)
    assert len(failures._windows) == 3 and len(failures._pending) <= 4
    assert failures.retry_after("10.0.0.9") == pytest.approx(60.0)  # a remembered peer stays refused
    assert failures.retry_after("10.0.0.0") is None  # forgotten: its next failures count afresh
    await asyncio.gather(*kept)
    assert sum(e["num_failures"] for e in events) == 20
    assert any(e["peer"] == OTHER_PEERS for e in events)
    clock.now += 60.0
    assert failures.retry_after("10.0.0.9") is None  # its window is over
