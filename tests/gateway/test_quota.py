"""Quotas under concurrency, on SQLite and PostgreSQL: reservations never let usage overshoot a limit."""

import asyncio
import time

import pytest
from litestar.testing import AsyncTestClient

from gateway.app import create_app
from gateway.errors import QuotaExceeded
from gateway.services import tenants
from gateway.services.quota import QuotaService, window_bounds
from gateway.storage.db import make_db_engine, make_sessionmaker
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
    services = [QuotaService(make_sessionmaker(e), e.dialect.name) for e in engines]
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
    for e in engines:
        await e.dispose()


async def test_concurrency_slots_released(db_url):
    policy = Policy(max_concurrent_requests=2)
    tid = await _tenant(db_url, policy)
    engine = make_db_engine(db_url)
    q = QuotaService(make_sessionmaker(engine), engine.dialect.name)
    a = await q.reserve(tid, policy, 1, time.time())
    await q.reserve(tid, policy, 1, time.time())
    with pytest.raises(QuotaExceeded) as exc:
        await q.reserve(tid, policy, 1, time.time())
    assert exc.value.code == "concurrency_limit"
    await q.settle(a[0], 1, 0, 0)
    assert await q.reserve(tid, policy, 1, time.time())
    await engine.dispose()


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
