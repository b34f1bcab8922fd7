"""Module boundaries and the migration: audit imports nothing from kvgate; 0002 matches audit.tables."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sqlalchemy import inspect

from audit.store import AuditStore
from audit.tables import metadata

AUDIT_DIR = Path(__file__).resolve().parents[2] / "audit"
PROJECT_PACKAGES = {"gateway", "engine", "policies", "kernels", "migrations", "bench", "kvgate"}


def test_audit_imports_nothing_from_the_project() -> None:
    for path in AUDIT_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in PROJECT_PACKAGES, f"{path.name} imports {name}"


def test_audit_modules_stay_small() -> None:
    for path in AUDIT_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 300, path.name


async def _check_migrated(url: str, data_dir: Path) -> None:
    from gateway.storage.migrate import downgrade, upgrade

    await upgrade(url)
    store = await AuditStore.open(url, data_dir)
    try:
        def _columns(sync_conn):  # type: ignore[no-untyped-def]
            insp = inspect(sync_conn)
            return {t.name: {c["name"] for c in insp.get_columns(t.name)} for t in metadata.sorted_tables}

        async with store.engine.connect() as conn:
            migrated = await conn.run_sync(_columns)
        assert migrated == {t.name: {c.name for c in t.columns} for t in metadata.sorted_tables}
        await store.record("service.started", version="test", pid=1)
        assert (await store.head()).seq == 1
    finally:
        await store.close()
    await downgrade(url, "0001_initial")


async def test_migration_0002_sqlite(tmp_path: Path) -> None:
    await _check_migrated(f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}", tmp_path)


@pytest.mark.postgres
async def test_migration_0002_postgres(pg_url: str, tmp_path: Path) -> None:
    await _check_migrated(pg_url, tmp_path)
