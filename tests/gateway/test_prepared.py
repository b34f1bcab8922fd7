"""``audit.prepared``: prebuilt statements on the DBAPI cursor, on SQLite and on PostgreSQL (asyncpg)."""

from datetime import UTC, datetime

import pytest
from sqlalchemy import Connection, bindparam, insert, select
from sqlalchemy.exc import DBAPIError, IntegrityError

from audit.prepared import execute, execute_many
from gateway.storage.db import make_db_engine
from gateway.storage.models import AdminToken

from .conftest import backend_pid, open_runner, terminate_backend

_TOKENS = AdminToken.__table__
_INSERT = insert(_TOKENS).values(id=bindparam("id"), name=bindparam("name"), secret_hash="0" * 64,
                                 created_at=bindparam("at"), scopes="")
_BY_NAME = select(_TOKENS.c.id, _TOKENS.c.created_at).where(_TOKENS.c.name == bindparam("name")).order_by(
    _TOKENS.c.id)
_AT = datetime(2026, 11, 24, 9, 30, tzinfo=UTC)


def _no_sqlalchemy_execution(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("went through Connection.execute")

    monkeypatch.setattr(Connection, "execute", refuse)


async def test_rows_match_sqlalchemy_and_skip_its_execution(db_url: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``TxnRunner``, as the gateway runs them: SQLite's writer (pysqlite) and PostgreSQL's
    ``run_sync`` (asyncpg) both take the direct path."""
    rows = [{"id": f"t{i}", "name": "p", "at": _AT} for i in range(3)]

    def body(sync_conn: Connection) -> list:
        execute_many(sync_conn, _INSERT, rows)
        return execute(sync_conn, _BY_NAME, {"name": "p"})

    async with open_runner(db_url) as (db, runner):
        with monkeypatch.context() as m:
            _no_sqlalchemy_execution(m)
            got = await runner.run(body)
        async with db.connect() as conn:  # type: ignore[attr-defined]
            expected = [tuple(r) for r in (await conn.execute(_BY_NAME, {"name": "p"})).all()]
    assert got == expected and [r[0] for r in got] == ["t0", "t1", "t2"]
    assert all(isinstance(r[1], datetime) for r in got)  # result processors applied as SQLAlchemy does


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
async def test_postgresql_errors_are_sqlalchemys(db_url: str) -> None:
    db = make_db_engine(db_url)
    try:
        row = {"id": "dup", "name": "p", "at": _AT}
        with pytest.raises(IntegrityError):
            async with db.begin() as conn:
                await conn.run_sync(lambda c: (execute(c, _INSERT, row), execute(c, _INSERT, row)))
        await terminate_backend(db_url, await backend_pid(db))
        # The pool's one connection, used moments ago, is not pinged: its first statement finds it gone.
        with pytest.raises(DBAPIError) as caught:
            async with db.begin() as conn:
                await conn.run_sync(execute, _BY_NAME, {"name": "p"})
        assert caught.value.connection_invalidated
        async with db.begin() as conn:  # the pool reconnects
            assert await conn.run_sync(execute, _BY_NAME, {"name": "p"}) == []
    finally:
        await db.dispose()
