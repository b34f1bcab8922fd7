"""PostgreSQL connection pool: a connection is pinged only after sitting idle, and a dead one is replaced;
a lost connection is a 503 the client may retry."""

from collections.abc import AsyncIterator

import orjson
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import exception_handlers
from gateway.storage import db as db_module
from gateway.storage.db import make_db_engine

from .conftest import PG_HOST, PG_PORT, backend_pid, terminate_backend


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


@pytest.fixture
async def pool(pg_url: str) -> AsyncIterator[AsyncEngine]:
    """A pooled engine, as ``kvgate serve`` makes it."""
    engine = make_db_engine(pg_url)
    yield engine
    await engine.dispose()


@pytest.mark.postgres
async def test_a_connection_used_moments_ago_is_not_pinged(pool: AsyncEngine, pings: list[int],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pid = await backend_pid(pool)
    assert await backend_pid(pool) == pid and await backend_pid(pool) == pid
    assert pings == []
    monkeypatch.setattr(db_module, "IDLE_PING_S", 0.0)  # now every checked-in connection counts as idle
    assert await backend_pid(pool) == pid
    assert pings == [1]


@pytest.mark.postgres
async def test_an_idle_connection_whose_server_went_away_is_replaced(pool: AsyncEngine, pg_url: str,
                                                                     pings: list[int],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pid = await backend_pid(pool)
    await terminate_backend(pg_url, pid)
    monkeypatch.setattr(db_module, "IDLE_PING_S", 0.0)
    assert await backend_pid(pool) != pid  # the ping failed, the pool connected afresh
    assert pings == [1]


@pytest.mark.postgres
async def test_a_recently_used_dead_connection_fails_one_transaction_then_the_pool_reconnects(
        pool: AsyncEngine, pg_url: str) -> None:
    pid = await backend_pid(pool)
    await terminate_backend(pg_url, pid)
    with pytest.raises(DBAPIError) as caught:
        await backend_pid(pool)
    assert caught.value.connection_invalidated
    assert await backend_pid(pool) != pid


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
