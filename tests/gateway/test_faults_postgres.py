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

from .faultload import SERVE_ARGS, Load, Outcome, chat, client, keep_calling, model_id, until
from .ledger import settled_ledgers
from .private_pg import PrivatePostgres, missing_reason, private_postgres
from .served import Served, serve

pytestmark = [pytest.mark.timeout(300), pytest.mark.postgres]
NUM_WORKERS = 8
MAX_TOKENS = 48  # long enough that requests are still generating when the database goes down


@pytest.fixture
def pg() -> PrivatePostgres:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with private_postgres() as server:
        yield server


def _num_refused(outcomes: list[Outcome]) -> int:
    """How many of ``outcomes`` were refused for the outage; every other one must be a whole answer."""
    for out in outcomes:
        if out.status == 503:
            assert out.code == "database_unavailable", out
            assert int(out.retry_after or 0) > 0, out
        else:
            assert out.is_ok, out  # never a 500, never a stream cut short
    return sum(out.status == 503 for out in outcomes)


async def _through_an_outage(server: Served, pg: PrivatePostgres, keys: list[str]) -> tuple[Load, float]:
    """Load, then the database server stopped until the gateway has refused requests for it and every
    request generating when it stopped has ended, then started again; returns the load and when the
    server was down."""
    load, stop = Load([], {}), asyncio.Event()
    body = chat(model_id(server, keys[0]), max_tokens=MAX_TOKENS, ignore_eos=True)
    async with client(server) as c:
        workers = [asyncio.create_task(keep_calling(c, keys, body, i, load, stop))
                   for i in range(NUM_WORKERS)]
        try:
            await until(lambda: sum(o.is_ok for o in load.outcomes) >= NUM_WORKERS, "answers")
            await asyncio.to_thread(pg.stop)
            down, num_before = time.monotonic(), len(load.outcomes)
            await until(lambda: _num_refused(load.outcomes[num_before:]) >= NUM_WORKERS
                        and load.is_past(down), "refusals during the outage")
            await asyncio.to_thread(pg.start)
            back = time.monotonic()
            await until(lambda: sum(o.is_ok and o.started > back for o in load.outcomes) >= 2 * NUM_WORKERS,
                        "answers after the restart")
        finally:
            stop.set()
            await asyncio.gather(*workers)
    return load, down


def test_a_postgresql_restart_under_load_is_503s_then_recovery_with_nothing_lost(
        tmp_path, tiny_model_dir, pg: PrivatePostgres) -> None:
    with serve(tmp_path, tiny_model_dir, *SERVE_ARGS, env={"KVGATE_DB_URL": pg.url}) as server:
        tenants = [server.make_tenant(f"pg-restart-{i}") for i in range(3)]
        load, down = asyncio.run(_through_an_outage(server, pg, [key for _, key in tenants]))
        _num_refused(load.outcomes)
        ledgers = settled_ledgers(pg.url, tmp_path, [tid for tid, _ in tenants])
        assert "request.unhandled" not in server.log()
    # Requests generating when the database went down were answered, and settled once it was back.
    assert any(o.is_ok and o.started < down < o.ended for o in load.outcomes)
    answered = {o.request_id: o.usage for o in load.outcomes if o.is_ok}
    admitted = {rid for ledger in ledgers.values() for rid in ledger.admitted}
    assert admitted == set(answered)  # every admitted request was answered, every answer admitted
    for ledger in ledgers.values():
        for rid, (event,) in ledger.finished.items():
            usage = answered[rid]
            assert (event["num_prompt_tokens"], event["num_completion_tokens"]) == (
                usage["prompt_tokens"], usage["completion_tokens"])


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
