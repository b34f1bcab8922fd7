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
from audit.purge import purge_before
from audit.retention import RecordUnreadable, RetentionStore, load_or_create_master_key
from audit.store import AuditStore, AuditUnavailable, format_ts, make_audit_engine
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


async def test_ids_are_stored_as_given_when_a_prompt_holds_them(store: AuditStore, tmp_path: Path) -> None:
    ids = {"request_id": "req-77f3", "tenant_id": "tenant-4f2a9c1e", "key_id": "0123456789abcdef"}
    with request_context(**ids):
        register_sensitive(*ids.values(), "admin-9f1c")  # a chat whose messages are its own ids
        await store.append(make_event(REQUEST_FINISHED, model="m", finish_reason="stop"))
        await store.append(make_event(ADMIN_ACTION, actor="admin-9f1c", action="key.update"))
    async with store.engine.connect() as conn:
        rows = (await conn.execute(select(audit_events).order_by(audit_events.c.seq))).mappings().all()
    assert [(r["request_id"], r["tenant_id"], r["key_id"], r["actor"]) for r in rows] == [
        (*ids.values(), None), (*ids.values(), "admin-9f1c")]
    await export_bundle(store, tmp_path / "tenant", ExportSpec(tenant=ids["tenant_id"]))
    result = verify_bundle(tmp_path / "tenant", store.keys.public_key)
    assert result.ok and result.num_events == 2, result


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
    result = await purge_before(store, cut_time, actor="test")
    assert (result.cut_seq, result.num_deleted) == (9, 9)
    async with store.engine.connect() as conn:
        seqs = [r.seq for r in (await conn.execute(select(audit_events.c.seq))).all()]
        cps = [r.seq for r in (await conn.execute(select(audit_checkpoints.c.seq))).all()]
        last = (await conn.execute(select(audit_events).order_by(audit_events.c.seq.desc()))).first()
    assert seqs == list(range(10, 16)) and 9 in cps and last.name == AUDIT_PURGED
    assert (await verify_store(store)).ok
    manifest = await export_bundle(store, tmp_path / "after", ExportSpec())
    assert manifest["anchor"]["seq"] == 9 and manifest["purge"]["seq"] == 15
    result = verify_bundle(tmp_path / "after", store.keys.public_key)
    assert result.ok and result.first_seq == 10, result
    # A tenant's export does not hold the purge event, but carries it as the proof of its anchor.
    await export_bundle(store, tmp_path / "t1", ExportSpec(tenant="t1"))
    assert verify_bundle(tmp_path / "t1", store.keys.public_key).ok
    # A second purge cuts past the first one's event; its own event records the new cut.
    cut_time = datetime.now(UTC)
    await append_events(store, 3)
    assert (await purge_before(store, cut_time)).cut_seq == 17  # the purge at 15 and two exports went too
    assert (await verify_store(store)).ok
    await export_bundle(store, tmp_path / "again", ExportSpec())
    assert verify_bundle(tmp_path / "again", store.keys.public_key).ok


async def _delete_rows(store: AuditStore, *where) -> None:
    async with store.engine.begin() as conn:
        await conn.execute(audit_events.delete().where(*where))


async def test_rows_deleted_from_the_end_fail_verification(store: AuditStore) -> None:
    await append_events(store, 10)
    await _delete_rows(store, audit_events.c.seq > 8)
    check = await verify_store(store)
    assert not check.ok and check.first_bad_seq == 9 and "head is at seq 10" in check.reason, check
    await _delete_rows(store)
    assert not (await verify_store(store)).ok


async def test_rows_deleted_from_the_start_without_a_purge_fail_verification(store: AuditStore) -> None:
    await append_events(store, 10)  # checkpoints at 4 and 8
    await _delete_rows(store, audit_events.c.seq <= 4)
    check = await verify_store(store)
    assert not check.ok and check.first_bad_seq == 5 and "audit.purged" in check.reason, check


async def test_purge_cuts_by_sequence_when_clocks_disagree(store: AuditStore,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Replicas share the chain with skewed clocks: seq 5 comes from one that runs an hour behind.
    cut_time = datetime(2026, 3, 1, 12, tzinfo=UTC)
    for hours in (-3, -2, -1, +1, -1, +2):
        stamp = format_ts(cut_time + timedelta(hours=hours))
        monkeypatch.setattr("audit.store.now_ts", lambda stamp=stamp: stamp)
        await append_events(store, 1)
    monkeypatch.undo()
    result = await purge_before(store, cut_time, actor="test")
    assert (result.cut_seq, result.num_deleted) == (3, 3)
    async with store.engine.connect() as conn:
        seqs = (await conn.execute(select(audit_events.c.seq).order_by(audit_events.c.seq))).scalars().all()
    assert seqs == [4, 5, 6, 7]  # seq 4 is newer than the cut-off: neither it nor anything after goes
    assert (await verify_store(store)).ok


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


async def test_events_joined_in_one_transaction_chain_as_if_appended_one_by_one(store: AuditStore) -> None:
    from audit.sink import AppendStep, store_txn_sink
    from gateway.audit_hook import AuditHook, AuditUnavailableError, chain_steps

    hook = AuditHook()
    hook.set_txn_sink(store_txn_sink(store), None)  # ``run`` is only for lone events (``emit``)
    ran: list[str] = []

    def fields(i: int) -> dict:
        return {"kind": "tenant", "key_id": f"k{i}", "tenant_id": "t", "path": "/v1/chat/completions"}

    async def run(step) -> None:
        async with store.engine.begin() as conn:
            await conn.run_sync(step)

    await run(hook.step("auth.success", **fields(1)))
    joined = chain_steps(hook.step("auth.success", **fields(2)), None, hook.step("auth.success", **fields(3)),
                         hook.step("auth.success", **fields(4)))
    assert isinstance(joined.append, AppendStep) and len(joined.append.events) == 3  # one append
    await run(joined)  # seqs 2..4: crosses checkpoint_every=4 inside one append
    split = chain_steps(hook.step("auth.success", **fields(5)), lambda conn: ran.append("other"),
                        hook.step("auth.success", **fields(6)))
    await run(split)  # another step in between keeps its place: no join across it
    assert ran == ["other"]

    async with store.engine.connect() as conn:
        rows = (await conn.execute(select(audit_events.c.seq, audit_events.c.key_id)
                                   .order_by(audit_events.c.seq))).all()
        cps = [r.seq for r in (await conn.execute(select(audit_checkpoints.c.seq))).all()]
    assert [(r.seq, r.key_id) for r in rows] == [(i, f"k{i}") for i in range(1, 7)]
    assert cps == [4] and (await store.head()).seq == 6 and (await verify_store(store)).ok

    def broken(conn, events):
        raise RuntimeError("disk gone")

    store.append_many_sync = broken  # type: ignore[method-assign]
    with pytest.raises(AuditUnavailableError):
        await run(chain_steps(hook.step("auth.success", **fields(7)), hook.step("auth.success", **fields(8))))
    del store.append_many_sync
    assert (await store.head()).seq == 6  # nothing of the failed transaction holds


def test_a_purge_event_from_before_purges_recorded_their_link_still_proves_its_cut() -> None:
    from audit.events import records_purge

    legacy = {"name": AUDIT_PURGED, "seq": 15, "data": {"before": "x", "cut_seq": 9, "num_deleted": 9}}
    assert records_purge(legacy, 9, "abc")  # chained after the cut: proof enough of what it removed
    assert not records_purge(legacy, 8, "abc")
    current = legacy | {"data": legacy["data"] | {"cut_hash": "abc"}}
    assert records_purge(current, 9, "abc") and not records_purge(current, 9, "other")
    assert not records_purge(legacy | {"seq": 9}, 9, "abc")  # a purge event is written after its cut
