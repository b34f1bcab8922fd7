"""PostgreSQL connection pool: a connection is pinged only after sitting idle, and a dead one is replaced;
a lost connection is a 503 the client may retry."""

import orjson
import pytest
from sqlalchemy import text
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_connection
from sqlalchemy.exc import DBAPIError

from gateway.errors import exception_handlers
from gateway.storage import db as db_module
from gateway.storage.db import make_db_engine

from .conftest import PG_HOST, PG_PORT


@pytest.fixture
def pg_url(pg_user: str | None) -> str:
    if pg_user is None:
        pytest.skip(f"no PostgreSQL server answers at {PG_HOST}:{PG_PORT} (set CI=1 to make this a failure)")
    return f"postgresql+asyncpg://{pg_user}@{PG_HOST}:{PG_PORT}/postgres"


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts pings of pooled asyncpg connections (each one three round trips)."""
    calls: list[int] = []
    real = AsyncAdapt_asyncpg_connection.ping

    def counting(self: AsyncAdapt_asyncpg_connection) -> None:
        calls.append(1)
        real(self)

    monkeypatch.setattr(AsyncAdapt_asyncpg_connection, "ping", counting)
    return calls


async def _backend_pid(engine) -> int:  # type: ignore[no-untyped-def]
    async with engine.begin() as conn:
        return (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()


async def _terminate(url: str, pid: int) -> None:
    other = make_db_engine(url)
    try:
        async with other.begin() as conn:
            assert (await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})).scalar_one()
    finally:
        await other.dispose()


@pytest.mark.postgres
async def test_a_connection_used_moments_ago_is_not_pinged(pg_url: str, pings: list[int],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_db_engine(pg_url)
    try:
        pid = await _backend_pid(engine)
        assert await _backend_pid(engine) == pid and await _backend_pid(engine) == pid
        assert pings == []
        monkeypatch.setattr(db_module, "IDLE_PING_S", 0.0)  # now every checked-in connection counts as idle
        assert await _backend_pid(engine) == pid
        assert pings == [1]
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_an_idle_connection_whose_server_went_away_is_replaced(pg_url: str, pings: list[int],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_db_engine(pg_url)
    try:
        pid = await _backend_pid(engine)
        await _terminate(pg_url, pid)
        monkeypatch.setattr(db_module, "IDLE_PING_S", 0.0)
        assert await _backend_pid(engine) != pid  # the ping failed, the pool connected afresh
        assert pings == [1]
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_a_recently_used_dead_connection_fails_one_transaction_then_the_pool_reconnects(
        pg_url: str) -> None:
    engine = make_db_engine(pg_url)
    try:
        pid = await _backend_pid(engine)
        await _terminate(pg_url, pid)
        with pytest.raises(DBAPIError) as caught:
            await _backend_pid(engine)
        assert caught.value.connection_invalidated
        assert await _backend_pid(engine) != pid
    finally:
        await engine.dispose()


@pytest.mark.parametrize("is_lost", [True, False])
def test_a_lost_connection_is_a_503_and_other_database_errors_a_500(is_lost: bool) -> None:
    error = DBAPIError("SELECT 1", {}, ConnectionError("gone"), connection_invalidated=is_lost)
    response = exception_handlers[DBAPIError](None, error)  # type: ignore[arg-type,index]
    body = orjson.loads(response.render(response.content, "application/json"))  # type: ignore[arg-type]
    if is_lost:
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert body["error"]["code"] == "database_unavailable"
    else:
        assert response.status_code == 500 and body["error"]["code"] is None
    assert "SELECT" not in str(body)  # the statement stays in the (redacted) server log
