"""``kvgate audit export/verify/purge/public-key`` end to end on a migrated SQLite database."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from audit.store import AuditStore
from gateway.cli import app
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
