"""Streaming, signed audit export: events in a range (optionally one tenant's) plus chain proofs.

Guarantee (checked by ``audit.verify.verify_bundle`` with only the public key): every exported
event sits at its exact chain position, and the chain runs unbroken from an anchor (genesis or a
signed checkpoint) to a signed checkpoint at or after the last event. An export without ``since``
claims the whole retained chain: its anchor is genesis or a purge's cut, proven by the manifest's
``purge`` (the ``audit.purged`` event naming the cut, checked at its own chain position); without
``until`` the chain runs to the newest checkpoint, the head signed as the export starts. A table
with rows deleted at either end therefore exports as a bundle that fails verification.
Positions that are not exported appear in ``chain.jsonl`` only as two digests (tenant, body), so:
  - unfiltered: every position in ``first_seq..last_seq`` must be present as a full event;
  - tenant-filtered: every position whose tenant digest equals the tenant's must be present, so
    omitting one of the tenant's events is detected too. Other tenants' events are revealed only as
    digests (the body digest covers a random 128-bit event id, so it cannot be guessed), but their
    number and positions are visible, and anyone who knows another tenant's id can tell its events.
The manifest is signed at export time; checkpoints were signed when the events were written, so a
later rewrite of the database (without the signing key) cannot produce a verifying bundle.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import func, select

from audit import bundle, chain
from audit.events import AUDIT_EXPORTED, make_event
from audit.keys import public_key_pem
from audit.purge import find_purge_record
from audit.store import AuditStore, fail_closed, format_ts, now_ts
from audit.tables import audit_checkpoints, audit_events

_CP_KEYS = ("seq", "link", "chain_hash", "created_at", "signature")


@dataclass(frozen=True, slots=True)
class ExportSpec:
    since: datetime | None = None
    until: datetime | None = None
    tenant: str | None = None
    fmt: str = "jsonl"

    def __post_init__(self) -> None:
        if self.fmt not in bundle.EVENT_FILES:
            raise ValueError(f"format must be one of {sorted(bundle.EVENT_FILES)}")


class _HashedFile:
    def __init__(self, path: Path) -> None:
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha.update(data)

    def close(self) -> str:
        self.file.close()
        return self.sha.hexdigest()


async def _plan(store: AuditStore, spec: ExportSpec) -> dict[str, Any]:
    """Resolve the time range to seq bounds, the anchor and the end checkpoint."""
    async with store.engine.connect() as conn:
        # Events appended after the newest checkpoint wait for the next export: the range must end
        # at or before a signed position even while writers keep appending.
        signed = (await conn.execute(select(func.max(audit_checkpoints.c.seq)))).scalar() or 0
        q = select(func.min(audit_events.c.seq), func.max(audit_events.c.seq)).where(
            audit_events.c.seq <= signed)
        if spec.since is not None:
            q = q.where(audit_events.c.ts >= format_ts(spec.since))
        if spec.until is not None:
            q = q.where(audit_events.c.ts < format_ts(spec.until))
        first, last = (await conn.execute(q)).one()
        if first is None:
            return {"first": None, "last": None, "anchor": None, "checkpoints": [], "purge": None}
        anchor = (await conn.execute(select(audit_checkpoints).where(audit_checkpoints.c.seq < first)
                                     .order_by(audit_checkpoints.c.seq.desc()).limit(1))).mappings().first()
        anchor_seq = anchor["seq"] if anchor else 0
        # An export from the start of the retained chain proves where it starts: at genesis, or at a cut
        # that the ``audit.purged`` event it carries records. Without ``until`` it runs to the newest
        # checkpoint, so events deleted from the end of the table cannot go unnoticed.
        purge = await find_purge_record(conn, anchor_seq, str(anchor["link"])) if (
            anchor and spec.since is None) else None
        reach = max(last if spec.until is not None else signed, purge["seq"] if purge else 0)
        end_seq = (await conn.execute(select(func.min(audit_checkpoints.c.seq)).where(
            audit_checkpoints.c.seq >= reach))).scalar()
        cps = (await conn.execute(select(audit_checkpoints).where(
            audit_checkpoints.c.seq >= anchor_seq, audit_checkpoints.c.seq <= end_seq)
            .order_by(audit_checkpoints.c.seq))).mappings().all()
    return {"first": first, "last": last, "end": end_seq, "purge": purge,
            "checkpoints": [{k: c[k] for k in _CP_KEYS} for c in cps],
            "anchor": {"seq": anchor_seq, "link": str(anchor["link"]) if anchor else chain.GENESIS}}


async def write_bundle_dir(store: AuditStore, out_dir: Path, spec: ExportSpec) -> dict[str, Any]:
    """Write the bundle files into ``out_dir`` (created); returns the manifest."""
    with fail_closed("export"):
        await store.checkpoint()  # the head must be signed so the last event has an end checkpoint
        plan = await _plan(store, spec)
        out_dir.mkdir(parents=True, exist_ok=False)
        events_name = bundle.EVENT_FILES[spec.fmt]
        events, proof = _HashedFile(out_dir / events_name), _HashedFile(out_dir / bundle.CHAIN)
        if spec.fmt == "csv":
            events.write(bundle.csv_header())
        try:
            stats = await _stream_positions(store, plan, spec, events, proof)
        finally:
            digests = {events_name: events.close(), bundle.CHAIN: proof.close()}
    manifest = _manifest(store, spec, plan, stats, digests)
    manifest_bytes = chain.canonical_json(manifest)
    (out_dir / bundle.MANIFEST).write_bytes(manifest_bytes)
    (out_dir / bundle.SIGNATURE).write_text(store.keys.sign(manifest_bytes) + "\n")
    (out_dir / bundle.PUBLIC_KEY).write_bytes(public_key_pem(store.keys.public_key))
    return manifest


async def _stream_positions(store: AuditStore, plan: dict[str, Any], spec: ExportSpec,
                            events: _HashedFile, proof: _HashedFile) -> dict[str, Any]:
    stats: dict[str, Any] = {"events": 0, "chain": 0, "first_chain_hash": None, "last_chain_hash": None}
    if plan["first"] is None:
        return stats
    # A damaged table is exported as it is: a missing position shows as a gap that the verifier names.
    async for record in store.iter_records(plan["anchor"]["seq"] + 1, plan["end"]):
        tenant_hex, body_hex, _ = chain.link_record(record)
        proof.write(chain.canonical_json({"seq": record["seq"], "tenant": tenant_hex, "body": body_hex,
                                          "link": record["link"]}) + b"\n")
        stats["chain"] += 1
        if plan["first"] <= record["seq"] <= plan["last"] and (
                spec.tenant is None or record["tenant_id"] == spec.tenant):
            events.write(bundle.encode_event(record, spec.fmt))
            stats["events"] += 1
            stats["first_chain_hash"] = stats["first_chain_hash"] or record["chain_hash"]
            stats["last_chain_hash"] = record["chain_hash"]
    return stats


def _manifest(store: AuditStore, spec: ExportSpec, plan: dict[str, Any], stats: dict[str, Any],
              digests: dict[str, str]) -> dict[str, Any]:
    return {
        "format": bundle.FORMAT,
        "created_at": now_ts(),
        "event_format": spec.fmt,
        "events_file": bundle.EVENT_FILES[spec.fmt],
        "range": {"since": format_ts(spec.since) if spec.since else None,
                  "until": format_ts(spec.until) if spec.until else None,
                  "first_seq": plan["first"], "last_seq": plan["last"]},
        "tenant": spec.tenant,
        "tenant_digest": chain.tenant_digest(spec.tenant) if spec.tenant is not None else None,
        "anchor": plan["anchor"],
        "end_seq": plan.get("end"),
        "counts": {"events": stats["events"], "chain": stats["chain"],
                   "checkpoints": len(plan["checkpoints"])},
        "first_chain_hash": stats["first_chain_hash"],
        "last_chain_hash": stats["last_chain_hash"],
        "checkpoints": plan["checkpoints"],
        "purge": plan["purge"],
        "public_key_fingerprint": store.keys.fingerprint,
        "files": digests,
    }


async def record_export(store: AuditStore, spec: ExportSpec, manifest: dict[str, Any],
                        actor: str | None) -> None:
    """Append the ``audit.exported`` event (after the bundle is built, so it can name its digest)."""
    await store.append(make_event(
        AUDIT_EXPORTED, actor=actor, tenant_id=spec.tenant, since=manifest["range"]["since"],
        until=manifest["range"]["until"],
        tenant=spec.tenant, format=spec.fmt, num_events=manifest["counts"]["events"],
        first_seq=manifest["range"]["first_seq"], last_seq=manifest["range"]["last_seq"],
        manifest_sha256=hashlib.sha256(chain.canonical_json(manifest)).hexdigest()))


async def export_bundle(store: AuditStore, out: Path, spec: ExportSpec, *,
                        actor: str | None = None) -> dict[str, Any]:
    """Export to ``out``: a directory, or one ``.tar`` file when ``out`` ends with ``.tar``.

    Raises:
        FileExistsError: ``out`` exists.
        AuditUnavailable: The store could not be read or the export could not be recorded.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(out)
    if out.suffix != ".tar":
        manifest = await write_bundle_dir(store, out, spec)
    else:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".kvgate-export-") as tmp:
            manifest = await write_bundle_dir(store, Path(tmp) / "bundle", spec)
            _write_tar(Path(tmp) / "bundle", Path(tmp) / "bundle.tar")
            os.replace(Path(tmp) / "bundle.tar", out)
    await record_export(store, spec, manifest, actor)
    return manifest


def _write_tar(src: Path, dest: Path) -> None:
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(p.name for p in src.iterdir()):
            tar.add(src / name, arcname=name, recursive=False)


async def stream_bundle_tar(store: AuditStore, spec: ExportSpec, *, actor: str | None = None,
                            chunk_size: int = 1 << 16) -> AsyncIterator[bytes]:
    """Async generator of ``.tar`` bundle bytes for HTTP responses; spools to a temp dir, not memory.

    The bundle is complete and the export recorded before the first chunk is yielded, so an
    ``AuditUnavailable`` surfaces before any response bytes (prime the generator to get a 503).
    """
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-export-"))
    try:
        manifest = await write_bundle_dir(store, tmp / "bundle", spec)
        _write_tar(tmp / "bundle", tmp / "bundle.tar")
        await record_export(store, spec, manifest, actor)
        with open(tmp / "bundle.tar", "rb") as f:
            while chunk := f.read(chunk_size):
                yield chunk
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
