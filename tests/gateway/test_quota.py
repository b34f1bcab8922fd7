"""Quotas under concurrency, on SQLite and PostgreSQL: reservations never let usage overshoot a limit."""

import asyncio
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack

import httpx
import pytest
from sqlalchemy import delete

from gateway.errors import QuotaExceeded
from gateway.limits.quota import QuotaService, Reservation, window_bounds
from gateway.limits.slots import FORGET_AFTER_LEASES, Slots
from gateway.storage.db import make_db_engine, make_sessionmaker
from gateway.storage.models import UsageCounter
from gateway.storage.txn import TxnRunner
from gateway.tenancy import tenants
from policies import Policy

from .conftest import SETUP, make_settings
from .realserver import RealServer, max_in_flight, migrated_db, serve


async def _well_inside_a_minute() -> float:
    """Now, or the start of the next minute when this one ends within 5 s (a test's reservations must
    all fall into one minute window)."""
    now = time.time()
    if window_bounds(now)[1][0] - now < 5:
        await asyncio.sleep(window_bounds(now)[1][0] - now + 0.1)
        now = time.time()
    return now


def _reservation(q: QuotaService, tid: str, num_tokens: int, now: float) -> Reservation:
    """What ``q.reserve(tid, ..., num_tokens, now)`` hands back when it holds."""
    return Reservation(tid, num_tokens, window_bounds(now)[0], q.slots.instance_id)


async def _tenant(url: str, policy: Policy) -> str:
    engine = make_db_engine(url, null_pool=True)
    async with make_sessionmaker(engine)() as s:
        t = await tenants.create_tenant(s, SETUP, f"q{time.monotonic_ns()}", policy)
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
    now = await _well_inside_a_minute()

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
    reservation, info = await services[0].reserve(tid, policy, 5, now)
    assert reservation == _reservation(services[0], tid, 5, now) and info.remaining_tokens == 0
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
    now = time.time()
    assert (await q.reserve(tid, policy, 1, now))[0] == _reservation(q, tid, 1, now)
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
    for _ in range(2):
        assert (await alive.reserve(tid, policy, 1, t0 + 34))[0] == _reservation(alive, tid, 1, t0 + 34)
    assert await _refused(alive, tid, policy, t0 + 34)


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
    assert (await alive.reserve(tid, policy, 1, now))[0] == _reservation(alive, tid, 1, now)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def shared_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One migrated database for the module's real servers."""
    pg_user = request.getfixturevalue("pg_user") if request.param == "postgresql" else None
    if request.param == "postgresql" and pg_user is None:
        pytest.skip("no PostgreSQL server answers (set CI=1 to make this a failure)")
    with migrated_db(request.param, tmp_path_factory.mktemp("quota-db"), pg_user) as url:
        yield url


@pytest.fixture(scope="module")
def servers(shared_db: str, tmp_path_factory: pytest.TempPathFactory, llm) -> Iterator[list[RealServer]]:
    """Two gateway instances sharing one database (and data directory), like two `kvgate serve`
    processes, each a real uvicorn on its own loopback port."""
    data_dir = tmp_path_factory.mktemp("quota-servers")
    settings = make_settings(data_dir, shared_db)
    with serve(settings, llm) as a, serve(settings, llm) as b:
        yield [a, b]


def _chat(model: str, i: int, max_tokens: int, **extra: object) -> dict:
    messages = [{"role": "user", "content": f"count {i}"}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


async def _fire(
    servers: list[RealServer], key: str, model: str, n: int, max_tokens: int
) -> list[httpx.Response]:
    """``n`` chat completions sent at once, round-robin over the servers, each on its own connection."""
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=s.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)) for s in servers]
        return await asyncio.gather(*(
            clients[i % len(clients)].post("/v1/chat/completions", json=_chat(model, i, max_tokens))
            for i in range(n)
        ))


async def test_http_requests_never_overshoot_tokens_per_minute(servers, llm):
    """N concurrent HTTP requests through two instances sharing one database stay within the limit; the
    servers saw them in flight together."""
    limit = 200
    tid, key = await servers[0].make_tenant(Policy(tokens_per_minute=limit))
    await _well_inside_a_minute()
    for s in servers:
        s.recorder.spans.clear()
    responses = await _fire(servers, key, llm.model_name, 12, 8)
    assert max_in_flight([span for s in servers for span in s.recorder.spans]) >= 2
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes
    limited = next(r for r in responses if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.headers["x-ratelimit-limit-tokens"] == str(limit)
    assert limited.json()["error"]["type"] == "rate_limit_error"
    ok = next(r for r in responses if r.status_code == 200)
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) < limit
    async with httpx.AsyncClient(base_url=servers[1].base_url, headers=servers[1].admin()) as admin:
        rows = (await admin.get(f"/admin/v1/tenants/{tid}/usage?window=minute")).json()
    assert all(row["total_tokens"] <= limit for row in rows)
    settled = sum(r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200)
    assert settled == sum(row["total_tokens"] for row in rows) > 0


async def test_http_concurrency_limit_holds_across_instances(servers, llm):
    """Two streams in flight, one on each instance, take both of the tenant's slots: a third request is
    refused while they run, and once their clients leave the slots come back."""
    _, key = await servers[0].make_tenant(Policy(max_concurrent_requests=2))
    headers = {"Authorization": f"Bearer {key}"}
    long_stream = _chat(llm.model_name, 0, 1000, stream=True)
    async with AsyncExitStack() as stack:
        streams = []  # held: a line iterator dropped half-way closes its connection
        for s in servers:
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=s.base_url, timeout=60))
            r = await stack.enter_async_context(
                client.stream("POST", "/v1/chat/completions", headers=headers, json=long_stream))
            assert r.status_code == 200
            streams.append(r.aiter_lines())
            assert (await anext(streams[-1])).startswith("data: ")  # admitted, generating
        async with httpx.AsyncClient(base_url=servers[0].base_url, headers=headers, timeout=60) as client:
            r = await client.post("/v1/chat/completions", json=_chat(llm.model_name, 1, 1))
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit", r.text
        assert int(r.headers["retry-after"]) >= 1
    # both clients left mid-stream: their requests are aborted and settled, which frees the slots
    deadline = time.monotonic() + 20
    while True:
        responses = await _fire(servers, key, llm.model_name, 2, 1)
        if [r.status_code for r in responses] == [200, 200] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]


async def test_daily_quota_and_requests_per_minute(servers, llm):
    _, key = await servers[0].make_tenant(Policy(requests_per_minute=2))
    await _well_inside_a_minute()
    responses = await _fire(servers[:1], key, llm.model_name, 1, 1)
    responses += await _fire(servers, key, llm.model_name, 2, 1)
    assert sorted(r.status_code for r in responses) == [200, 200, 429]
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    _, key = await servers[0].make_tenant(Policy(daily_token_quota=45))
    responses = await _fire(servers, key, llm.model_name, 3, 2)
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
