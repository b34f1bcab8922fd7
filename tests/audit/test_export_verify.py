"""Signed export bundles: round trips, tenant filters, and tamper detection naming the first bad record."""

from __future__ import annotations

import shutil
import tarfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from audit import bundle
from audit.export import ExportSpec, export_bundle, stream_bundle_tar
from audit.keys import AuditKeys, public_key_pem
from audit.store import AuditStore
from audit.verify import verify_bundle
from tests.audit.conftest import append_events

EV = "events.jsonl"


async def _bundle(store: AuditStore, tmp_path: Path, n: int = 10, **spec) -> Path:
    await append_events(store, n)
    out = tmp_path / "bundle"
    await export_bundle(store, out, ExportSpec(**spec))
    return out


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def _edit_event(line: bytes, **changes) -> bytes:
    record = orjson.loads(line)
    record["data"].update(changes)
    return orjson.dumps(record) + b"\n"


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
async def test_full_export_verifies(store: AuditStore, tmp_path: Path, fmt: str) -> None:
    out = await _bundle(store, tmp_path, fmt=fmt)
    result = verify_bundle(out, store.keys.public_key)
    assert result.ok, result
    assert (result.num_events, result.first_seq, result.last_seq, result.is_key_pinned) == (10, 1, 10, True)
    manifest = orjson.loads((out / bundle.MANIFEST).read_bytes())
    assert manifest["counts"]["events"] == 10 and manifest["public_key_fingerprint"] == store.keys.fingerprint
    assert manifest["checkpoints"][-1]["seq"] == manifest["end_seq"] >= 10


async def test_tenant_export_is_complete_and_bound(store: AuditStore, tmp_path: Path) -> None:
    out = await _bundle(store, tmp_path, n=12, tenant="t2")
    result = verify_bundle(out, store.keys.public_key)
    assert result.ok and result.num_events == 6 and result.tenant == "t2"
    lines = _lines(out / EV)
    assert all(orjson.loads(line)["tenant_id"] == "t2" for line in lines)
    assert b'"t1"' not in (out / EV).read_bytes() and b"t1" not in (out / bundle.CHAIN).read_bytes()
    # Dropping one of the tenant's events is caught: the verifier knows which positions are the tenant's.
    _write(out / EV, lines[:2] + lines[3:])
    bad = verify_bundle(out, store.keys.public_key)
    assert not bad.ok and bad.bad_record == f"{EV} line 3 (seq 8)", bad


async def test_range_export_and_tar_and_stream(store: AuditStore, tmp_path: Path) -> None:
    await append_events(store, 6)
    mid = datetime.now(UTC)
    await append_events(store, 6)
    spec = ExportSpec(since=mid, until=datetime.now(UTC) + timedelta(seconds=1))
    manifest = await export_bundle(store, tmp_path / "b.tar", spec)
    assert manifest["range"]["first_seq"] == 7 and manifest["anchor"]["seq"] == 4
    assert verify_bundle(tmp_path / "b.tar", store.keys.public_key).ok
    chunks = [c async for c in stream_bundle_tar(store, ExportSpec(tenant="t1"))]
    (tmp_path / "s.tar").write_bytes(b"".join(chunks))
    result = verify_bundle(tmp_path / "s.tar", public_key_pem(store.keys.public_key))
    assert result.ok and result.num_events == 6, result


async def test_empty_export_verifies(store: AuditStore, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    await export_bundle(store, out, ExportSpec(tenant="nobody"))
    assert verify_bundle(out, store.keys.public_key).ok


# Each tamper: (mutation of the bundle directory, expected first bad record).
def _modify(out: Path) -> None:
    lines = _lines(out / EV)
    lines[2] = _edit_event(lines[2], num_completion_tokens=999)
    _write(out / EV, lines)


def _delete(out: Path) -> None:
    lines = _lines(out / EV)
    _write(out / EV, lines[:2] + lines[3:])


def _insert(out: Path) -> None:
    lines = _lines(out / EV)
    _write(out / EV, lines[:2] + [lines[1]] + lines[2:])


def _reorder(out: Path) -> None:
    lines = _lines(out / EV)
    lines[2], lines[3] = lines[3], lines[2]
    _write(out / EV, lines)


def _truncate_events(out: Path) -> None:
    _write(out / EV, _lines(out / EV)[:-2])


def _truncate_chain(out: Path) -> None:
    _write(out / bundle.CHAIN, _lines(out / bundle.CHAIN)[:-3])


def _edit_chain(out: Path) -> None:
    lines = _lines(out / bundle.CHAIN)
    record = orjson.loads(lines[4])
    record["body"] = "ab" * 32
    lines[4] = orjson.dumps(record) + b"\n"
    _write(out / bundle.CHAIN, lines)


def _swap_signature(out: Path) -> None:
    other = AuditKeys.generate()
    (out / bundle.SIGNATURE).write_text(other.sign((out / bundle.MANIFEST).read_bytes()))


def _swap_public_key(out: Path) -> None:
    # A forger re-signs the manifest with their own key and ships their public key.
    other = AuditKeys.generate()
    (out / bundle.PUBLIC_KEY).write_bytes(public_key_pem(other.public_key))
    (out / bundle.SIGNATURE).write_text(other.sign((out / bundle.MANIFEST).read_bytes()))


def _edit_manifest(out: Path) -> None:
    manifest = orjson.loads((out / bundle.MANIFEST).read_bytes())
    manifest["counts"]["events"] = 9
    (out / bundle.MANIFEST).write_bytes(orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS))


def _whitespace(out: Path) -> None:
    lines = _lines(out / EV)
    lines[5] = lines[5].rstrip(b"\n") + b" \n"
    _write(out / EV, lines)


TAMPERS = {
    "modify": (_modify, f"{EV} line 3 (seq 3)"),
    "delete": (_delete, f"{EV} line 3 (seq 4)"),
    "insert": (_insert, f"{EV} line 3 (seq 2)"),
    "reorder": (_reorder, f"{EV} line 3 (seq 4)"),
    "truncate_events": (_truncate_events, f"{EV} (seq 9)"),
    "truncate_chain": (_truncate_chain, f"{bundle.CHAIN} (seq"),
    "edit_chain": (_edit_chain, f"{bundle.CHAIN} line 5 (seq 5)"),
    "swap_signature": (_swap_signature, bundle.SIGNATURE),
    "swap_public_key": (_swap_public_key, bundle.PUBLIC_KEY),
    "edit_manifest": (_edit_manifest, bundle.SIGNATURE),
    "whitespace": (_whitespace, EV),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
async def test_tampering_is_detected(store: AuditStore, tmp_path: Path, name: str) -> None:
    out = await _bundle(store, tmp_path)
    assert verify_bundle(out, store.keys.public_key).ok
    mutate, expected = TAMPERS[name]
    mutate(out)
    result = verify_bundle(out, store.keys.public_key)
    assert not result.ok
    assert result.bad_record is not None and result.bad_record.startswith(expected), (name, str(result))


async def test_unpinned_key_still_catches_record_tampering(store: AuditStore, tmp_path: Path) -> None:
    out = await _bundle(store, tmp_path)
    _modify(out)
    result = verify_bundle(out, None)
    assert not result.ok and result.bad_record == f"{EV} line 3 (seq 3)" and not result.is_key_pinned


async def test_tampering_inside_tar(store: AuditStore, tmp_path: Path) -> None:
    await append_events(store, 10)
    await export_bundle(store, tmp_path / "b.tar", ExportSpec(fmt="csv"))
    work = tmp_path / "x"
    with tarfile.open(tmp_path / "b.tar") as tar:
        tar.extractall(work, filter="data")
    lines = _lines(work / "events.csv")
    lines[4] = lines[4].replace(b"t2", b"t3", 1)  # line 5 = header + seq 4
    _write(work / "events.csv", lines)
    with tarfile.open(tmp_path / "evil.tar", "w") as tar:
        for p in sorted(work.iterdir()):
            tar.add(p, arcname=p.name)
    result = verify_bundle(tmp_path / "evil.tar", store.keys.public_key)
    assert not result.ok and result.bad_record == "events.csv line 5 (seq 4)", result
    shutil.rmtree(work)


async def test_export_while_writers_append(store: AuditStore, tmp_path: Path) -> None:
    import asyncio

    await append_events(store, 5)
    writer = asyncio.create_task(append_events(store, 30))
    await asyncio.sleep(0.01)
    await export_bundle(store, tmp_path / "live", ExportSpec())
    await writer
    assert verify_bundle(tmp_path / "live", store.keys.public_key).ok
