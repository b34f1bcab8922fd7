"""Benchmark: peak RSS and time of a signed audit export (and its offline verify) over N events.

Run directly (``python -m bench.audit_export --num-events 100000``) or via ``run(...)`` from
``kvgate bench audit``. Seeding writes correctly chained rows in bulk (the per-event append path
is measured by the tests, not here), so only export and verify are timed and sampled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
from sqlalchemy import insert, update

from audit import chain
from audit.export import ExportSpec, export_bundle
from audit.store import AuditStore, Head, now_ts
from audit.tables import audit_checkpoints, audit_events, audit_head
from audit.verify import verify_bundle

_MIB = 1 << 20


class _PeakRss:
    """Sample this process's RSS every few milliseconds on a thread."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self._proc, self._interval = psutil.Process(os.getpid()), interval_s
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _row(seq: int, head: Head, chain_key: bytes) -> tuple[dict[str, Any], Head]:
    record = {"seq": seq, "event_id": secrets.token_hex(16), "ts": now_ts(), "name": "request.finished",
              "tenant_id": f"tenant-{seq % 7}", "key_id": f"{seq % 31:016x}", "request_id": f"req-{seq}",
              "actor": None, "data": {"model": "smollm2", "num_prompt_tokens": seq % 900,
                                      "num_completion_tokens": seq % 200, "latency_ms": 12.5,
                                      "finish_reason": "stop", "prompt_hash": f"{seq:032x}"}}
    tenant_hex, body_hex, canonical = chain.link_record(record)
    link = chain.next_link(head.link, tenant_hex, body_hex)
    mac = chain.next_chain_hash(chain_key, head.chain_hash, canonical)
    return {**record, "data": orjson.dumps(record["data"], option=orjson.OPT_SORT_KEYS).decode(),
            "link": link, "chain_hash": mac}, Head(seq, link, mac)


async def seed(store: AuditStore, num_events: int, *, batch: int = 2000) -> None:
    """Insert ``num_events`` valid chained events with a checkpoint every ``store.checkpoint_every``."""
    head = await store.head()
    for start in range(head.seq + 1, head.seq + num_events + 1, batch):
        rows, cps = [], []
        for seq in range(start, min(start + batch, head.seq + num_events + 1)):
            row, head = _row(seq, head, store.keys.chain_key)
            rows.append(row)
            if seq % store.checkpoint_every == 0:
                created = now_ts()
                message = chain.checkpoint_message(seq, head.link, head.chain_hash, created)
                cps.append({"seq": seq, "link": head.link, "chain_hash": head.chain_hash,
                            "created_at": created, "signature": store.keys.sign(message)})
        async with store.engine.begin() as conn:
            await conn.execute(insert(audit_events), rows)
            if cps:
                await conn.execute(insert(audit_checkpoints), cps)
            await conn.execute(update(audit_head).where(audit_head.c.id == 1).values(
                seq=head.seq, link=head.link, chain_hash=head.chain_hash))


def _bundle_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())


async def _run(num_events: int, work: Path, tenant: str | None, fmt: str, db_url: str | None) -> dict:
    store = await AuditStore.open(db_url or f"sqlite+aiosqlite:///{work / 'bench.db'}", work,
                                  create_tables=True)
    try:
        t0 = time.perf_counter()
        await seed(store, num_events)
        seed_s = time.perf_counter() - t0
        rss_before = psutil.Process().memory_info().rss
        out = work / "bundle.tar"
        with _PeakRss() as export_peak:
            t0 = time.perf_counter()
            manifest = await export_bundle(store, out, ExportSpec(tenant=tenant, fmt=fmt))
            export_s = time.perf_counter() - t0
        with _PeakRss() as verify_peak:
            t0 = time.perf_counter()
            result = verify_bundle(out, store.keys.public_key)
            verify_s = time.perf_counter() - t0
    finally:
        await store.close()
    return {"num_events": num_events, "num_exported": manifest["counts"]["events"], "tenant": tenant,
            "format": fmt, "seed_s": round(seed_s, 2), "export_s": round(export_s, 2),
            "export_events_per_s": round(manifest["counts"]["chain"] / export_s),
            "verify_s": round(verify_s, 2), "verify_ok": result.ok,
            "bundle_mib": round(_bundle_bytes(out) / _MIB, 1),
            "rss_before_mib": round(rss_before / _MIB, 1),
            "peak_rss_export_mib": round(export_peak.peak / _MIB, 1),
            "peak_rss_export_delta_mib": round((export_peak.peak - rss_before) / _MIB, 1),
            "peak_rss_verify_delta_mib": round((verify_peak.peak - rss_before) / _MIB, 1)}


def run(num_events: int = 100_000, *, tenant: str | None = None, fmt: str = "jsonl",
        db_url: str | None = None, workdir: Path | None = None) -> dict:
    """Seed a fresh audit DB (SQLite in a temp dir unless ``db_url``), export, verify; return metrics."""
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-audit-", dir=workdir) as tmp:
        return asyncio.run(_run(num_events, Path(tmp), tenant, fmt, db_url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-events", type=int, default=100_000)
    parser.add_argument("--tenant")
    parser.add_argument("--format", default="jsonl", choices=["jsonl", "csv"])
    args = parser.parse_args()
    print(json.dumps(run(args.num_events, tenant=args.tenant, fmt=args.format), indent=2))


if __name__ == "__main__":
    main()
