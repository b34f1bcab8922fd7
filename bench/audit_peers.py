"""One measured peer of ``kvgate bench audit`` per process, so each peak RSS is that peer's own.

``python -m bench.audit_peers PEER WORKDIR [N]`` prints one JSON object. The work dir holds the seeded
``bench.db`` and the audit keys (``bench.audit_export.seed`` wrote them). Peers:

    export_stream   the signed export: keyset pages streamed to a .tar (what the CLI and API do)
    load_list       the same events loaded into one list and serialized in memory (a naive export)
    verify          offline verification of export_stream's bundle with only the public key
    append_chained  N events through AuditStore.append: head lock, HMAC and SHA-256 chain, own transaction
    insert_plain    the same N events as plain INSERTs, one transaction each, no chain and no lock
"""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
from sqlalchemy import insert, select

from audit.events import REQUEST_FINISHED, make_event
from audit.export import ExportSpec, export_bundle
from audit.store import AuditStore, make_audit_engine, now_ts
from audit.tables import audit_events
from audit.verify import verify_bundle

_MIB = 1 << 20
BUNDLE = "bundle.tar"
PLAIN_TABLE = "bench_plain_events"


def db_url(work: Path) -> str:
    return f"sqlite+aiosqlite:///{work / 'bench.db'}"


def _rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _memory(before: int) -> dict[str, float]:
    peak = _peak()
    return {"peak_rss_mib": round(peak / _MIB, 1), "peak_rss_delta_mib": round((peak - before) / _MIB, 1)}


async def export_stream(work: Path) -> dict[str, Any]:
    store = await AuditStore.open(db_url(work), work)
    try:
        before, t0 = _rss(), time.perf_counter()
        manifest = await export_bundle(store, work / BUNDLE, ExportSpec())
        seconds = time.perf_counter() - t0
    finally:
        await store.close()
    return {"num_events": manifest["counts"]["events"], "seconds": round(seconds, 2),
            "bytes_mib": round((work / BUNDLE).stat().st_size / _MIB, 1), **_memory(before)}


async def load_list(work: Path) -> dict[str, Any]:
    engine = make_audit_engine(db_url(work))
    try:
        before, t0 = _rss(), time.perf_counter()
        async with engine.connect() as conn:
            rows = (await conn.execute(select(audit_events).order_by(audit_events.c.seq))).all()
        # str(): column keys are SQLAlchemy quoted_name objects, which orjson refuses as dict keys.
        records = [{**{str(k): v for k, v in row._mapping.items()}, "data": orjson.loads(row.data)}
                   for row in rows]
        blob = b"".join(orjson.dumps(r) + b"\n" for r in records)
        (work / "naive.jsonl").write_bytes(blob)
        seconds = time.perf_counter() - t0
    finally:
        await engine.dispose()
    return {"num_events": len(records), "seconds": round(seconds, 2),
            "bytes_mib": round(len(blob) / _MIB, 1), **_memory(before)}


def verify(work: Path) -> dict[str, Any]:
    from audit.keys import load_or_create_keys

    key = load_or_create_keys(work).public_key
    before, t0 = _rss(), time.perf_counter()
    result = verify_bundle(work / BUNDLE, key)
    return {"num_events": result.num_events, "ok": result.ok, "seconds": round(time.perf_counter() - t0, 2),
            **_memory(before)}


def _fields(i: int) -> dict[str, Any]:
    return {"tenant_id": f"tenant-{i % 7}", "request_id": f"w-{i}", "model": "smollm2",
            "num_prompt_tokens": i % 900, "num_completion_tokens": i % 200, "latency_ms": 12.5,
            "finish_reason": "stop", "prompt_hash": f"{i:032x}"}


async def append_chained(work: Path, n: int) -> dict[str, Any]:
    store = await AuditStore.open(db_url(work), work)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            await store.append(make_event(REQUEST_FINISHED, **_fields(i)))
        seconds = time.perf_counter() - t0
    finally:
        await store.close()
    return {"num_events": n, "seconds": round(seconds, 2), "events_per_s": round(n / seconds)}


async def insert_plain(work: Path, n: int) -> dict[str, Any]:
    from sqlalchemy import MetaData

    # Same columns, unique constraint and indexes as audit_events (renamed), so only the chain differs.
    plain = audit_events.to_metadata(MetaData(), name=PLAIN_TABLE)
    for index in plain.indexes:
        index.name = str(index.name).replace("audit_events", PLAIN_TABLE)
    engine = make_audit_engine(db_url(work))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(plain.metadata.create_all)
        stmt = insert(plain)  # built once, as the store's own statements are
        t0 = time.perf_counter()
        for i in range(n):
            event = make_event(REQUEST_FINISHED, **_fields(i))
            row = {"seq": i + 1, "event_id": secrets.token_hex(16), "ts": now_ts(), "name": event.name,
                   "tenant_id": event.tenant_id, "key_id": None, "request_id": event.request_id,
                   "actor": None, "data": orjson.dumps(event.data, option=orjson.OPT_SORT_KEYS).decode(),
                   "link": "", "chain_hash": ""}
            async with engine.begin() as conn:
                await conn.execute(stmt, row)
        seconds = time.perf_counter() - t0
    finally:
        await engine.dispose()
    return {"num_events": n, "seconds": round(seconds, 2), "events_per_s": round(n / seconds)}


def main(argv: list[str]) -> None:
    peer, work = argv[0], Path(argv[1])
    if peer == "verify":
        out = verify(work)
    elif peer in ("append_chained", "insert_plain"):
        out = asyncio.run(globals()[peer](work, int(argv[2])))
    elif peer in ("export_stream", "load_list"):
        out = asyncio.run(globals()[peer](work))
    else:
        raise SystemExit(f"unknown peer {peer!r}")
    sys.stdout.write(orjson.dumps(out).decode() + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
