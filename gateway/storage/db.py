"""Async SQLAlchemy engine and sessionmaker for SQLite (default) or PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool


def default_db_url(data_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{data_dir / 'kvgate.db'}"


def normalize_db_url(url: str) -> str:
    """Accept plain ``postgresql://``/``sqlite://`` URLs and pick the async driver."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + url.split("://", 1)[1]
    if url.startswith("sqlite://"):
        return "sqlite+aiosqlite://" + url.split("://", 1)[1]
    return url


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


BUSY_TIMEOUT_MS = 10_000


def sqlite_pragmas(dbapi_conn, _record, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:  # type: ignore[no-untyped-def]
    cur = dbapi_conn.cursor()
    # busy_timeout first: even switching to WAL needs a lock another connection may hold.
    # WAL lets readers proceed during writes; busy_timeout makes concurrent writers wait, not fail.
    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def make_db_engine(url: str, *, null_pool: bool = False) -> AsyncEngine:
    """An async engine; ``null_pool`` opens a connection per session (PgBouncer, or several event loops)."""
    url = normalize_db_url(url)
    if null_pool:
        engine = create_async_engine(url, poolclass=NullPool)
        if is_sqlite(url):
            event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        return engine
    if is_sqlite(url):
        engine = create_async_engine(url, pool_size=5, max_overflow=10)
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        return engine
    return create_async_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)
