"""Store behaviour: fail-closed writes, secrets kept out of the table, purge, DB-side integrity, retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, text, update

from audit.context import register_sensitive, request_context
from audit.events import ADMIN_ACTION, AUDIT_PURGED, REQUEST_FINISHED, make_event
from audit.export import ExportSpec, export_bundle
from audit.integrity import verify_store
from audit.retention import RecordUnreadable, RetentionStore, load_or_create_master_key
from audit.store import AuditStore, AuditUnavailable, make_audit_engine
from audit.tables import audit_checkpoints, audit_events, retained_prompts
from audit.verify import verify_bundle
from tests.audit.conftest import append_events
from tests.audit.test_redact import CANARY, KVG_KEY

pytestmark = pytest.mark.timeout(60)


def test_event_fields_are_allow_listed() -> None:
    with pytest.raises(ValueError, match="not allowed"):
        make_event(REQUEST_FINISHED, prompt="hi")
    with pytest.raises(ValueError, match="unknown"):
        make_event("made.up")
    event = make_event(ADMIN_ACTION, action="key.update", before={"name": "a", "secret_hash": "x"},
                       after={"name": "b", "nested": {"token": "y"}})
    assert event.data == {"action": "key.update", "before": {"name": "a"},
                          "after": {"name": "b", "nested": {}}}


async def test_context_ids_and_no_secrets_in_table(store: AuditStore) -> None:
    with request_context(request_id="r1", tenant_id="t1", key_id="0123456789abcdef"):
        register_sensitive(f"prompt with {CANARY}")
        await store.append(make_event(REQUEST_FINISHED, model="m",
                                      finish_reason=f"error: 'prompt with {CANARY}' {KVG_KEY}",
                                      prompt_hash=store.keys.prompt_hash(f"prompt with {CANARY}")))
    async with store.engine.connect() as conn:
        row = (await conn.execute(select(audit_events))).mappings().one()
        dump = str(dict(row)) + str((await conn.execute(select(audit_checkpoints))).all())
    assert (row["request_id"], row["tenant_id"], row["key_id"]) == ("r1", "t1", "0123456789abcdef")
    assert CANARY not in dump and KVG_KEY.split("_", 2)[2] not in dump
    assert len(store.keys.prompt_hash("x")) == 32


async def test_unavailable_store_fails_closed(tmp_path: Path) -> None:
    store = await AuditStore.open(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", tmp_path, create_tables=True)
    async with store.engine.begin() as conn:
        await conn.execute(text("DROP TABLE audit_events"))
    with pytest.raises(AuditUnavailable, match="append"):
        await store.append(make_event(REQUEST_FINISHED, model="m"))
    await store.engine.dispose()
    down = AuditStore(make_audit_engine("postgresql+asyncpg://127.0.0.1:1/none"), store.keys)
    with pytest.raises(AuditUnavailable):
        await down.append(make_event(REQUEST_FINISHED, model="m"))


async def test_purge_keeps_remaining_chain_verifiable(store: AuditStore, tmp_path: Path) -> None:
    await append_events(store, 9)
    cut_time = datetime.now(UTC)
    await append_events(store, 5)
    result = await store.purge(cut_time, actor="test")
    assert (result.cut_seq, result.num_deleted) == (9, 9)
    async with store.engine.connect() as conn:
        seqs = [r.seq for r in (await conn.execute(select(audit_events.c.seq))).all()]
        cps = [r.seq for r in (await conn.execute(select(audit_checkpoints.c.seq))).all()]
        last = (await conn.execute(select(audit_events).order_by(audit_events.c.seq.desc()))).first()
    assert seqs == list(range(10, 16)) and 9 in cps and last.name == AUDIT_PURGED
    assert (await verify_store(store)).ok
    manifest = await export_bundle(store, tmp_path / "after", ExportSpec())
    assert manifest["anchor"]["seq"] == 9
    result = verify_bundle(tmp_path / "after", store.keys.public_key)
    assert result.ok and result.first_seq == 10, result


async def test_db_tampering_found_by_chain_key(store: AuditStore) -> None:
    await append_events(store, 6)
    async with store.engine.begin() as conn:
        await conn.execute(update(audit_events).where(audit_events.c.seq == 3).values(tenant_id="evil"))
    check = await verify_store(store)
    assert not check.ok and check.first_bad_seq == 3


async def test_crypto_shredding(store: AuditStore, tmp_path: Path) -> None:
    retention = RetentionStore(store.engine, load_or_create_master_key(tmp_path))
    rid = await retention.put("t1", f"prompt {CANARY}", "completion", retain_days=7, request_id="r1")
    other = await retention.put("t2", "other tenant", "ok", retain_days=7)
    record = await retention.get("t1", rid)
    assert record.prompt == f"prompt {CANARY}" and CANARY not in repr(record)
    async with store.engine.connect() as conn:
        blobs = b"".join(r.ciphertext for r in (await conn.execute(select(retained_prompts))).all())
    assert CANARY.encode() not in blobs
    with pytest.raises(RecordUnreadable):
        await retention.get("t2", rid)  # another tenant's id cannot read it
    assert await retention.shred_tenant("t1", delete_records=False) == 1
    with pytest.raises(RecordUnreadable, match="shredded"):
        await retention.get("t1", rid)
    assert (await retention.get("t2", other)).completion == "ok"
    assert await retention.purge_expired(datetime.now(UTC) + timedelta(days=8)) == 2


async def test_gateway_hook_sink_names(store: AuditStore) -> None:
    from audit.sink import store_sink

    sink = store_sink(store)
    await sink("auth.success", {"kind": "tenant", "key_id": "k", "tenant_id": "t", "path": "/v1/models"})
    await sink("request.finished", {"request_id": "r", "tenant_id": "t", "key_id": "k",
                                    "finish_reasons": ["stop"], "num_prompt_tokens": 3,
                                    "num_completion_tokens": 4, "num_cached_tokens": 0, "is_aborted": False})
    await sink("admin.key_rotated", {"actor": "admin1", "tenant_id": "t", "key_id": "k", "new_key_id": "k2"})
    with pytest.raises(ValueError):
        await sink("request.finished", {"prompt": "never"})
    assert (await store.head()).seq == 3 and (await verify_store(store)).ok
