"""Alembic: upgrade head / downgrade base / upgrade again, and the schema matches the ORM models."""

import pytest
from sqlalchemy import inspect

from gateway.storage import migrate
from gateway.storage.db import make_db_engine
from gateway.storage.models import Base
from tests.gateway.conftest import db_url, pg_user  # noqa: F401  (fixtures)


async def _tables(url: str) -> set[str]:
    engine = make_db_engine(url, null_pool=True)
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    await engine.dispose()
    return names


async def _columns(url: str, table: str) -> set[str]:
    engine = make_db_engine(url, null_pool=True)
    async with engine.connect() as conn:
        cols = await conn.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns(table)})
    await engine.dispose()
    return cols


async def test_upgrade_downgrade_roundtrip(db_url):  # noqa: F811
    # the fixture already upgraded to head
    tables = await _tables(db_url)
    assert set(Base.metadata.tables) <= tables
    for name, table in Base.metadata.tables.items():
        assert {c.name for c in table.columns} == await _columns(db_url, name), name
    await migrate.downgrade(db_url, "base")
    assert await _tables(db_url) <= {"alembic_version"}
    await migrate.upgrade(db_url)
    assert set(Base.metadata.tables) <= await _tables(db_url)


def test_first_revision_is_0001_initial():
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite+aiosqlite:///:memory:"))
    base = script.get_revision("0001_initial")
    assert base.down_revision is None
    assert len(script.get_heads()) == 1, "migrations must stay linear"


@pytest.mark.parametrize(
    "url,expected",
    [
        ("postgresql://u@h/d", "postgresql+asyncpg://u@h/d"),
        ("sqlite:////tmp/x.db", "sqlite+aiosqlite:////tmp/x.db"),
        ("postgresql+asyncpg://u@h/d", "postgresql+asyncpg://u@h/d"),
    ],
)
def test_normalize_db_url(url, expected):
    from gateway.storage.db import normalize_db_url

    assert normalize_db_url(url) == expected
