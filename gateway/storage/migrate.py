"""Run the Alembic migrations programmatically (``kvgate db upgrade`` and ``kvgate serve``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.storage.db import make_db_engine, normalize_db_url

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_db_url(url).replace("%", "%%"))
    return cfg


async def _run(engine: AsyncEngine, revision: str, *, down: bool) -> None:
    def _sync(connection) -> None:  # type: ignore[no-untyped-def]
        cfg = alembic_config(engine.url.render_as_string(hide_password=False))
        cfg.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(_sync)


async def upgrade(url_or_engine: str | AsyncEngine, revision: str = "head") -> None:
    """Upgrade the database to ``revision`` (default: head)."""
    if isinstance(url_or_engine, AsyncEngine):
        await _run(url_or_engine, revision, down=False)
        return
    engine = make_db_engine(url_or_engine)
    try:
        await _run(engine, revision, down=False)
    finally:
        await engine.dispose()


async def downgrade(url: str, revision: str = "base") -> None:
    """Downgrade the database to ``revision`` (default: base, i.e. drop everything)."""
    engine = make_db_engine(url)
    try:
        await _run(engine, revision, down=True)
    finally:
        await engine.dispose()


def current_revision_sync(url: str) -> None:
    command.current(alembic_config(url))
