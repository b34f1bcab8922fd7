"""Fixtures for the audit tests: a SQLite store per test and a throwaway PostgreSQL database."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from audit.events import REQUEST_FINISHED, make_event
from audit.store import AuditStore

PG_ADMIN_DSN = "postgresql://127.0.0.1:5432/test"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[AuditStore]:
    s = await AuditStore.open(f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}", tmp_path,
                              checkpoint_every=4, create_tables=True)
    yield s
    await s.close()


async def append_events(store: AuditStore, n: int, tenants: tuple[str, ...] = ("t1", "t2")) -> None:
    for i in range(n):
        await store.append(make_event(REQUEST_FINISHED, tenant_id=tenants[i % len(tenants)], model="m",
                                      num_prompt_tokens=i, num_completion_tokens=2 * i, latency_ms=1.25,
                                      finish_reason="stop", request_id=f"r{i}"))


async def _pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh database per test on 127.0.0.1:5432 (trust auth), dropped afterwards."""
    name = f"kvgate_audit_{secrets.token_hex(4)}"
    try:
        asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    except (TimeoutError, OSError, ImportError) as e:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required in CI: {e}")
        pytest.skip(f"no PostgreSQL server answers at 127.0.0.1:5432 ({type(e).__name__}: {e})")
    try:
        yield f"postgresql+asyncpg://127.0.0.1:5432/{name}"
    finally:
        asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
