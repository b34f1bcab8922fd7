"""``kvgate audit export/verify/purge/public-key`` end to end on a migrated SQLite database."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from audit.store import AuditStore
from gateway.cli import app
from gateway.cli.common import cli_actor
from tests.audit.conftest import append_events


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from gateway.storage.migrate import upgrade

    monkeypatch.setenv("KVGATE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("KVGATE_DB_URL", raising=False)
    url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"

    async def _prepare() -> None:
        await upgrade(url)
        store = await AuditStore.open(url, tmp_path)
        await append_events(store, 8)
        await store.close()

    asyncio.run(_prepare())
    return tmp_path


def test_export_verify_purge(data_dir: Path) -> None:
    runner = CliRunner()
    key = data_dir / "audit_public_key.pem"
    res = runner.invoke(app, ["audit", "export", "--out", str(data_dir / "b.tar"), "--tenant", "t1"])
    assert res.exit_code == 0, res.output
    assert "exported 4 events" in res.output
    res = runner.invoke(app, ["audit", "verify", str(data_dir / "b.tar"), "--public-key", str(key)])
    assert res.exit_code == 0 and res.output.startswith("OK: 4 events"), res.output
    res = runner.invoke(app, ["audit", "purge", "--before", "2999-01-01"])
    assert res.exit_code == 0 and "purged 9 events" in res.output, res.output  # 8 + the export event
    res = runner.invoke(app, ["audit", "export", "--out", str(data_dir / "after"), "--format", "csv"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["audit", "verify", str(data_dir / "after"), "--public-key", str(key)])
    assert res.exit_code == 0, res.output
    (data_dir / "after" / "events.csv").write_text("seq\n")
    res = runner.invoke(app, ["audit", "verify", str(data_dir / "after"), "--public-key", str(key)])
    assert res.exit_code == 1 and "FAILED at events.csv" in res.output, res.output
    res = runner.invoke(app, ["audit", "public-key"])
    assert res.exit_code == 0 and "BEGIN PUBLIC KEY" in res.output and "SHA256:" in res.output


async def _tamper(data_dir: Path, where) -> None:  # type: ignore[no-untyped-def]
    from audit.tables import audit_events

    store = await AuditStore.open(f"sqlite+aiosqlite:///{data_dir / 'kvgate.db'}", data_dir)
    await append_events(store, 4)  # seq 9..12; closing checkpoints 12 (8 was checkpointed before)
    await store.close()
    async with store.engine.begin() as conn:
        await conn.execute(audit_events.delete().where(where(audit_events.c.seq)))
    await store.engine.dispose()


@pytest.mark.parametrize("where,reason", [
    (lambda seq: seq > 10, "chain truncated: ends at seq 10"),
    (lambda seq: seq <= 8, "no audit.purged event records a purge there"),
], ids=["newest", "oldest"])
def test_bundle_of_a_store_with_rows_deleted_fails_verification(data_dir: Path, where, reason: str) -> None:
    asyncio.run(_tamper(data_dir, where))
    runner = CliRunner()
    res = runner.invoke(app, ["audit", "export", "--out", str(data_dir / "b.tar")])
    assert res.exit_code == 0, res.output
    key = data_dir / "audit_public_key.pem"
    res = runner.invoke(app, ["audit", "verify", str(data_dir / "b.tar"), "--public-key", str(key)])
    assert res.exit_code == 1 and reason in res.output, res.output


async def _retain(data_dir: Path) -> str:
    from datetime import UTC, datetime

    from sqlalchemy import update

    from audit.retention import RetentionStore, resolve_master_key
    from audit.store import make_audit_engine
    from audit.tables import retained_prompts

    engine = make_audit_engine(f"sqlite+aiosqlite:///{data_dir / 'kvgate.db'}")
    store = RetentionStore(engine, resolve_master_key(data_dir))
    try:
        kept = await store.put("t1", "prompt", ["completion"], retain_days=7)
        short = await store.put("t2", "prompt", ["completion"], retain_days=1)
        await store.get("t1", kept)
        async with engine.begin() as conn:
            await conn.execute(update(retained_prompts).where(retained_prompts.c.id == short).values(
                expires_at=datetime.now(UTC)))
    finally:
        await engine.dispose()
    return kept


async def _after(data_dir: Path, kept: str) -> tuple[list[str], int]:
    from sqlalchemy import func, select

    from audit.retention import RecordUnreadable, RetentionStore, resolve_master_key
    from audit.tables import audit_events, retained_prompts

    store = await AuditStore.open(f"sqlite+aiosqlite:///{data_dir / 'kvgate.db'}", data_dir)
    try:
        with pytest.raises(RecordUnreadable):
            await RetentionStore(store.engine, resolve_master_key(data_dir)).get("t1", kept)
        async with store.engine.connect() as conn:
            q = select(audit_events.c.name).where(audit_events.c.actor == cli_actor())
            names = (await conn.execute(q)).all()
            left = (await conn.execute(select(func.count()).select_from(retained_prompts))).scalar_one()
    finally:
        await store.close()
    return [n for (n,) in names], left


def test_shred_tenant_and_purge_retention(data_dir: Path) -> None:
    runner = CliRunner()
    kept = asyncio.run(_retain(data_dir))
    res = runner.invoke(app, ["audit", "shred-tenant", "t1"])
    assert res.exit_code == 2 and "--yes" in res.output
    res = runner.invoke(app, ["audit", "shred-tenant", "t1", "--yes"])
    assert res.exit_code == 0 and "1 retained records unreadable" in res.output, res.output
    res = runner.invoke(app, ["audit", "purge-retention"])
    assert res.exit_code == 0 and "purged 1 expired" in res.output, res.output
    names, left = asyncio.run(_after(data_dir, kept))
    assert names == ["retention.key_shredded", "retention.purged"] and left == 0
