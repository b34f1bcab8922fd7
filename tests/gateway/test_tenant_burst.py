"""A tenant's burst past its own request rate is that tenant's 429s, never the server's 503s, and never
another tenant's failure: against real ``kvgate serve`` processes (one on SQLite, then two replicas
sharing one PostgreSQL database), tenant C sends many times its ``requests_per_minute`` at once while
tenant B sends a few requests at the same moment. Each replica's gate lets C's rate through, so the
database refuses the rest; while C's reservations wait there, its requests hold no place B needs."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from audit.keys import load_or_create_keys
from audit.retention import resolve_master_key
from gateway.secrets import load_or_create_pepper

from .conftest import PG_HOST, PG_PORT
from .realserver import migrated_db
from .served import SHARED_SERVE_ARGS, Served, launch

pytestmark = pytest.mark.timeout(600)

RPM = 10  # tenant C's requests_per_minute
NUM_B = 8  # tenant B's requests, sent at the same moment as C's burst
OK = (200, None)
# A replica's engine places: KVGATE_MAX_NUM_SEQS running and as many queued.
NUM_PLACES = 16
REPLICA_ARGS = ("--num-kv-blocks", "1024", "--determinism-modes", "fast")
REPLICA_ENV = {"KVGATE_MAX_NUM_SEQS": str(NUM_PLACES // 2)}
# Secret files every replica must share (docs/operations.md#several-replicas-on-postgresql).
SECRET_FILES = ("pepper", "audit_chain.key", "audit_signing_key.pem", "audit_public_key.pem",
                "retention_master.key")
# Connections one client opens to one server: the shared server takes 256 from one peer, B's included.
MAX_CONNECTIONS = 240
BLOCKED_TIMEOUT_S = 60.0


def _away_from_a_minute_end() -> None:
    """Rates count per UTC minute: start early in one, so that the whole burst lands in it."""
    left = 60 - time.time() % 60
    if left < 15:
        time.sleep(left + 0.2)


def _model(server: Served, key: str) -> str:
    r = httpx.get(f"{server.base}/v1/models", verify=str(server.ca),
                  headers={"Authorization": f"Bearer {key}"})
    return r.json()["data"][0]["id"]


def _client(server: Served, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base, verify=str(server.ca), timeout=120,
                             headers={"Authorization": f"Bearer {key}"},
                             limits=httpx.Limits(max_connections=MAX_CONNECTIONS))


async def _post(client: httpx.AsyncClient, model: str) -> tuple[int, str | None]:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    r = await client.post("/v1/chat/completions", json=body)
    return r.status_code, None if r.status_code == 200 else r.json()["error"]["code"]


def _spread(servers: list[Served], key: str, model: str,
            num: int) -> tuple[list[Awaitable], list[httpx.AsyncClient]]:
    """``num`` requests of ``key``'s tenant, spread over ``servers`` as a load balancer spreads them, and
    the clients that send them."""
    clients = [_client(s, key) for s in servers]
    return [_post(clients[i % len(clients)], model) for i in range(num)], clients


async def _burst(servers: list[Served], keys: tuple[str, str], model: str,
                 num_c: int) -> tuple[Counter, Counter]:
    """C's ``num_c`` requests and B's ``NUM_B``, all at once; returns each tenant's (status, error code)
    counts."""
    key_b, key_c = keys
    sends_c, clients_c = _spread(servers, key_c, model, num_c)
    sends_b, clients_b = _spread(servers, key_b, model, NUM_B)
    try:  # B's requests come in the middle of C's burst
        replies = await asyncio.gather(*sends_c[: num_c // 2], *sends_b, *sends_c[num_c // 2:])
    finally:
        for c in clients_b + clients_c:
            await c.aclose()
    replies_b = replies[num_c // 2: num_c // 2 + NUM_B]
    return Counter(replies_b), Counter(replies[: num_c // 2] + replies[num_c // 2 + NUM_B:])


def _check(seen_b: Counter, seen_c: Counter, rpm: int) -> None:
    print(f"B: {dict(seen_b)}  C: {dict(seen_c)}")  # the counts, for the record of a run
    assert seen_b == Counter({OK: NUM_B})
    assert seen_c[OK] <= rpm
    assert all(status == 429 for status, _ in set(seen_c) - {OK}), seen_c  # C's own limits, no 503


def test_a_burst_over_the_tenants_rate_is_its_own_429s_and_no_other_tenants_failure(shared_server) -> None:
    server = shared_server(*SHARED_SERVE_ARGS)
    keys = server.make_key(f"burst-b-{time.monotonic_ns()}"), server.make_key(
        f"burst-c-{time.monotonic_ns()}", {"requests_per_minute": RPM})
    _away_from_a_minute_end()
    _check(*asyncio.run(_burst([server], keys, _model(server, keys[0]), 300)), RPM)


def _share_secrets(first: Path, second: Path) -> None:
    """The secret files of ``first`` (made here), copied into ``second`` as an operator copies them."""
    load_or_create_pepper(first)
    load_or_create_keys(first)
    resolve_master_key(first)
    second.mkdir(mode=0o700, exist_ok=True)
    for name in SECRET_FILES:
        shutil.copy2(first / name, second / name)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
             pg_user: str | None) -> Iterator[tuple[list[Served], str]]:
    """Two ``kvgate serve`` replicas of the tiny model on one fresh PostgreSQL database (its name)."""
    if pg_user is None:
        pytest.skip(f"no PostgreSQL server answers at {PG_HOST}:{PG_PORT}")
    root = tmp_path_factory.mktemp("replicas")
    dirs = [root / "one", root / "two"]
    dirs[0].mkdir(mode=0o700)
    _share_secrets(*dirs)
    with migrated_db("postgresql", root, pg_user) as url:
        env = REPLICA_ENV | {"KVGATE_DB_URL": url}
        servers: list[Served] = []
        try:
            servers += [launch(d, tiny_model_dir, *REPLICA_ARGS, env=env) for d in dirs]
            yield [s.ready() for s in servers], url
        finally:
            for s in servers:
                s.stop()


@pytest.mark.postgres
def test_across_two_replicas_a_burst_over_the_rate_is_still_its_own_429s(replicas) -> None:
    servers, _ = replicas
    keys = servers[0].make_key("b"), servers[0].make_key("c", {"requests_per_minute": RPM})
    _away_from_a_minute_end()
    _check(*asyncio.run(_burst(servers, keys, _model(servers[0], keys[0]), 40)), RPM)


async def _num_blocked(conn: asyncpg.Connection, num: int) -> None:
    """Wait until ``num`` sessions of this database wait for a lock (``conn`` outside any transaction:
    within one, PostgreSQL would show the activity as first read)."""
    deadline = time.monotonic() + BLOCKED_TIMEOUT_S
    query = ("SELECT count(*) FROM pg_stat_activity"
             " WHERE datname = current_database() AND wait_event_type = 'Lock'")
    while (found := await conn.fetchval(query)) < num:
        assert time.monotonic() < deadline, f"{found} of {num} reservations blocked"
        await asyncio.sleep(0.05)


async def _while_reservations_wait(servers: list[Served], db_url: str, keys: tuple[str, str],
                                   tenant_c: str, model: str, rpm: int) -> tuple[Counter, Counter]:
    """C's burst, whose reservations wait on C's tenant row (locked here) until B's requests, all to the
    first replica, are answered."""
    user, db = db_url.split("://")[1].split("@")[0], db_url.rsplit("/", 1)[1]
    lock, watch = [await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=user, database=db)
                   for _ in range(2)]
    sends_c, clients_c = _spread(servers, keys[1], model, 40)
    sends_b, clients_b = _spread(servers[:1], keys[0], model, NUM_B)
    try:
        async with lock.transaction():
            await lock.execute("SELECT id FROM tenants WHERE id = $1 FOR UPDATE", tenant_c)
            burst = asyncio.gather(*sends_c)
            await _num_blocked(watch, len(servers) * rpm)  # each replica's gate let C's rate through
            replies_b = await asyncio.gather(*sends_b)
        return Counter(replies_b), Counter(await burst)
    finally:
        for conn in (lock, watch):
            await conn.close()
        for c in clients_b + clients_c:
            await c.aclose()


@pytest.mark.postgres
def test_a_burst_the_database_has_not_refused_yet_holds_no_place_another_tenant_needs(replicas) -> None:
    """Each replica's gate lets C's whole rate through, as many requests as a replica has places; held
    in their reservation, they must leave B's requests every place."""
    servers, url = replicas
    rpm = NUM_PLACES
    tenant_c, key_c = servers[0].make_tenant("c-held", {"requests_per_minute": rpm})
    keys = servers[0].make_key("b-held"), key_c
    _away_from_a_minute_end()
    model = _model(servers[0], keys[0])
    _check(*asyncio.run(_while_reservations_wait(servers, url, keys, tenant_c, model, rpm)), rpm)
