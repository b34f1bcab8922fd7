"""Quotas under concurrency, on SQLite and PostgreSQL: reservations never let usage overshoot a limit."""

import asyncio
import time

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import delete

from gateway.app import create_app
from gateway.errors import QuotaExceeded
from gateway.services import tenants
from gateway.services.quota import QuotaService, window_bounds
from gateway.services.slots import FORGET_AFTER_LEASES, Slots
from gateway.storage.db import make_db_engine, make_sessionmaker
from gateway.storage.models import UsageCounter
from gateway.storage.txn import TxnRunner
from policies import Policy

from .conftest import make_settings, open_gateway


async def _tenant(url: str, policy: Policy) -> str:
    engine = make_db_engine(url, null_pool=True)
    async with make_sessionmaker(engine)() as s:
        t = await tenants.create_tenant(s, f"q{time.monotonic_ns()}", policy, "test")
    await engine.dispose()
    return t.id


@pytest.mark.parametrize("num_services", [1, 2])
async def test_concurrent_reservations_never_overshoot(db_url, num_services):
    """50 concurrent reservations of 10 tokens against 200/min: exactly 20 succeed (1 or 2 'processes')."""
    policy = Policy(tokens_per_minute=200, daily_token_quota=10_000)
    tid = await _tenant(db_url, policy)
    engines = [make_db_engine(db_url) for _ in range(num_services)]
    runners = [TxnRunner(e) for e in engines]
    services = [QuotaService(r) for r in runners]
    now = time.time()
    if window_bounds(now)[1][0] - now < 5:  # keep all reservations inside one minute window
        await asyncio.sleep(window_bounds(now)[1][0] - now + 0.1)
        now = time.time()

    async def one(i: int):
        try:
            return await services[i % num_services].reserve(tid, policy, 10, now)
        except QuotaExceeded as e:
            assert "retry-after" in e.headers
            return None

    results = await asyncio.gather(*(one(i) for i in range(50)))
    granted = [r for r in results if r is not None]
    assert len(granted) == 20
    # settling to less usage frees room again
    await services[0].settle(granted[0][0], 3, 2, 0)
    assert await services[0].reserve(tid, policy, 5, now)
    with pytest.raises(QuotaExceeded) as exc:
        await services[-1].reserve(tid, policy, 1, now)
    assert exc.value.headers["x-ratelimit-remaining-tokens"] == "0"
    for r, e in zip(runners, engines, strict=True):
        await r.close()
        await e.dispose()


async def test_concurrency_slots_released(db_url):
    policy = Policy(max_concurrent_requests=2)
    tid = await _tenant(db_url, policy)
    engine = make_db_engine(db_url)
    runner = TxnRunner(engine)
    q = QuotaService(runner)
    a = await q.reserve(tid, policy, 1, time.time())
    await q.reserve(tid, policy, 1, time.time())
    with pytest.raises(QuotaExceeded) as exc:
        await q.reserve(tid, policy, 1, time.time())
    assert exc.value.code == "concurrency_limit"
    await q.settle(a[0], 1, 0, 0)
    assert await q.reserve(tid, policy, 1, time.time())
    await runner.close()
    await engine.dispose()


async def test_usage_rows_deleted_behind_its_back_are_recreated(db_url):
    policy = Policy(tokens_per_minute=100)
    tid, now = await _tenant(db_url, policy), time.time()
    engine = make_db_engine(db_url, null_pool=True)
    runner = TxnRunner(engine)
    q = QuotaService(runner)
    try:
        await q.settle((await q.reserve(tid, policy, 10, now))[0], 4, 0, 0)  # rows now cached as existing
        async with engine.begin() as conn:
            await conn.execute(delete(UsageCounter).where(UsageCounter.tenant_id == tid))
        reservation, info = await q.reserve(tid, policy, 10, now)  # not a bogus 429: rows come back
        assert info.remaining_tokens == 90 and reservation.num_tokens == 10
    finally:
        await runner.close()
        await engine.dispose()


@pytest.fixture
async def two_instances(db_url):
    """Two gateway instances (own runner, own lease) sharing one database, like two processes."""
    engine = make_db_engine(db_url, null_pool=True)
    runners = [TxnRunner(engine), TxnRunner(engine)]
    yield [QuotaService(r, Slots(lease_s=30)) for r in runners], db_url
    for r in runners:
        await r.close()
    await engine.dispose()


async def _refused(q, tid, policy, now):
    with pytest.raises(QuotaExceeded) as exc:
        await q.reserve(tid, policy, 1, now)
    return exc.value.code == "concurrency_limit"


async def test_a_crashed_instance_slots_lapse_with_its_lease(two_instances):
    (crashed, alive), url = two_instances
    policy = Policy(max_concurrent_requests=2)
    tid, t0 = await _tenant(url, policy), time.time()
    held = [await crashed.reserve(tid, policy, 1, t0) for _ in range(2)]  # then it stops heartbeating
    assert await _refused(alive, tid, policy, t0 + 1)
    assert await _refused(alive, tid, policy, t0 + 29)  # still within the crashed instance's lease
    # Lapsed: both slots are back although nobody released them.
    taken = [await alive.reserve(tid, policy, 1, t0 + 31) for _ in range(2)]
    assert await _refused(alive, tid, policy, t0 + 31)
    for reservation, _ in taken:
        await alive.settle(reservation, 1, 0, 0)
    # A "crashed" instance that was only stalled comes back: its slots count again, and settling them
    # gives back exactly what it holds.
    await crashed.heartbeat(t0 + 33)
    assert await _refused(alive, tid, policy, t0 + 33)
    for reservation, _ in held:
        await crashed.settle(reservation, 1, 0, 0)
    assert await alive.reserve(tid, policy, 1, t0 + 34) and await alive.reserve(tid, policy, 1, t0 + 34)


async def test_forgotten_instance_settling_late_changes_nothing(two_instances):
    (gone, alive), url = two_instances
    policy = Policy(max_concurrent_requests=1)
    tid, t0 = await _tenant(url, policy), time.time()
    late, _ = await gone.reserve(tid, policy, 1, t0)
    await alive.heartbeat(t0 + 30 * FORGET_AFTER_LEASES + 1)  # forgets `gone` and its slot rows
    mine, _ = await alive.reserve(tid, policy, 1, t0 + 30 * FORGET_AFTER_LEASES + 2)
    await gone.settle(late, 1, 0, 0)  # its slot row is gone: nothing to give back, no error
    assert await _refused(alive, tid, policy, t0 + 30 * FORGET_AFTER_LEASES + 3)  # `mine` still held
    await alive.settle(mine, 1, 0, 0)


async def test_clean_shutdown_releases_every_slot_at_once(two_instances):
    (stopping, alive), url = two_instances
    policy = Policy(max_concurrent_requests=1)
    tid, now = await _tenant(url, policy), time.time()
    await stopping.reserve(tid, policy, 1, now)
    assert await _refused(alive, tid, policy, now)
    await stopping.release_all()
    assert await alive.reserve(tid, policy, 1, now)


async def _fire(clients, key, model, n, max_tokens):
    async def one(i):
        return await clients[i % len(clients)].post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": model,
                "messages": [{"role": "user", "content": f"count {i}"}],
                "max_tokens": max_tokens,
            },
        )

    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_http_requests_never_overshoot_tokens_per_minute(tmp_path, db_url, llm):
    """N concurrent HTTP requests through two app instances sharing one database stay within the limit."""
    limit = 200
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(tokens_per_minute=limit))
        app2 = create_app(make_settings(tmp_path, db_url), engine=llm)
        async with AsyncTestClient(app2, timeout=60) as client2:
            responses = await _fire([gw.client, client2], key, llm.model_name, 12, 8)
        codes = sorted(r.status_code for r in responses)
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes
        limited = next(r for r in responses if r.status_code == 429)
        assert int(limited.headers["retry-after"]) >= 1
        assert limited.headers["x-ratelimit-limit-tokens"] == str(limit)
        assert limited.json()["error"]["type"] == "rate_limit_error"
        ok = next(r for r in responses if r.status_code == 200)
        assert int(ok.headers["x-ratelimit-remaining-tokens"]) < limit
        rows = (
            await gw.client.get(f"/admin/v1/tenants/{tid}/usage?window=minute", headers=gw.admin())
        ).json()
        assert all(row["total_tokens"] <= limit for row in rows)
        settled = sum(r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200)
        assert settled == sum(row["total_tokens"] for row in rows)


async def test_daily_quota_and_requests_per_minute(gw):
    _, key = await gw.make_tenant(policy=Policy(requests_per_minute=2))
    responses = [r for r in await _fire([gw.client], key, gw.runtime.engine.model_name, 1, 1)]
    responses += await _fire([gw.client], key, gw.runtime.engine.model_name, 2, 1)
    assert sorted(r.status_code for r in responses) == [200, 200, 429]
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    _, key = await gw.make_tenant(policy=Policy(daily_token_quota=45))
    responses = await _fire([gw.client], key, gw.runtime.engine.model_name, 3, 2)
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 429
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.json()["error"]["code"] in ("insufficient_quota", "request_too_large")


@pytest.mark.parametrize("when", ["2024-02-29T23:59:59.500000", "2026-12-31T23:59:30", "2027-01-01T00:00:00",
                                  "2026-11-24T01:13:07.250000"])
def test_window_bounds_contain_the_instant_across_month_and_year_ends(when):
    from datetime import UTC, datetime

    t = datetime.fromisoformat(when).replace(tzinfo=UTC)
    now = t.timestamp()
    (minute, day, month), (minute_end, day_end, month_end) = window_bounds(now)
    assert minute <= now < minute_end == minute + 60 and day <= now < day_end == day + 86400
    assert datetime.fromtimestamp(month, UTC) == datetime(t.year, t.month, 1, tzinfo=UTC)
    nxt = datetime.fromtimestamp(month_end, UTC)
    assert nxt.day == 1 and nxt > t and (nxt.year, nxt.month) != (t.year, t.month)
    assert window_bounds(minute + 59.999) == window_bounds(now)  # the same minute: the same bounds
