"""A real ``kvgate serve`` on a PostgreSQL server that goes down under load and comes back: the requests
that meet the outage get a 503 to retry, the gateway recovers on its own, and the database afterwards
holds every admitted request settled exactly once, in an audit chain that verifies."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from gateway.errors import exception_handlers
from gateway.storage.db import make_db_engine, normalize_db_url

from .faultload import SERVE_ARGS, chat, model_id, through_a_fault
from .ledger import check_answers, settled_ledgers
from .private_pg import PrivatePostgres, missing_reason, private_postgres
from .served import serve

# Not marked ``postgres``: the server is the test's own, from the PostgreSQL binaries (skipped without).
pytestmark = pytest.mark.timeout(300)
NUM_WORKERS = 8
MAX_TOKENS = 48  # long enough that requests are still generating when the database goes down


@pytest.fixture
def pg() -> PrivatePostgres:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with private_postgres() as server:
        yield server


def test_a_postgresql_restart_under_load_is_503s_then_recovery_with_nothing_lost(
        tmp_path, tiny_model_dir, pg: PrivatePostgres) -> None:
    """The server is stopped under load until the gateway has refused requests for it and every request
    generating when it stopped has ended, then started again."""
    with serve(tmp_path, tiny_model_dir, *SERVE_ARGS, env={"KVGATE_DB_URL": pg.url}) as server:
        tenants = [server.make_tenant(f"pg-restart-{i}") for i in range(3)]
        keys = [key for _, key in tenants]
        body = chat(model_id(server, keys[0]), max_tokens=MAX_TOKENS, ignore_eos=True)
        load, down = asyncio.run(through_a_fault(server, keys, body, NUM_WORKERS, "database_unavailable",
                                                 pg.stop, pg.start))
        ledgers = settled_ledgers(pg.url, tmp_path, [tid for tid, _ in tenants])
        assert "request.unhandled" not in server.log()
    # Requests generating when the database went down were answered, and settled once it was back.
    assert any(o.is_ok and o.started < down < o.ended for o in load.outcomes)
    check_answers(ledgers, {o.request_id: o.usage for o in load.outcomes if o.is_ok})


async def _connect_error(url: str) -> DBAPIError | None:
    """What connecting to ``url`` raises (``None``: it connects)."""
    engine = make_db_engine(url)
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except DBAPIError as e:
        return e
    finally:
        await engine.dispose()
    return None


def _answer(error: DBAPIError) -> tuple[int, dict, dict]:
    response = exception_handlers[DBAPIError](None, error)  # type: ignore[arg-type,index]
    body = orjson.loads(response.render(response.content, "application/json"))  # type: ignore[arg-type]
    return response.status_code, {k.lower(): v for k, v in response.headers.items()}, body["error"]


def test_a_database_server_shutting_down_then_down_is_unavailable_not_an_error(pg: PrivatePostgres) -> None:
    """Connecting while the server shuts down (SQLSTATE 57P03) and once it is gone (connection refused)
    are both the database out of reach: a 503 to retry, not a 500."""
    url = normalize_db_url(pg.url)

    async def shutting_down_then_down() -> tuple[DBAPIError, DBAPIError]:
        holder = make_db_engine(url)
        async with holder.connect() as held:  # a smart shutdown waits for this session to end
            await held.execute(text("SELECT 1"))
            await asyncio.to_thread(pg.stop, "smart", wait=False)
            deadline = time.monotonic() + 60
            while (shutting := await _connect_error(url)) is None:
                assert time.monotonic() < deadline, "the server did not start shutting down"
        await holder.dispose()  # the last session ended: the server stops
        while not isinstance(getattr(down := await _connect_error(url), "orig", None), OSError):
            assert time.monotonic() < deadline, "the server did not stop"  # refused, once it is gone
        return shutting, down

    shutting, down = asyncio.run(shutting_down_then_down())
    assert getattr(shutting.orig, "sqlstate", None) == "57P03", shutting
    for error in (shutting, down):
        status, headers, body = _answer(error)
        assert (status, body["code"], headers["retry-after"]) == (503, "database_unavailable", "1"), error
