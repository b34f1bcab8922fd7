"""``kvgate bench audit``: signed-export memory and audit write throughput, each beside its naive peer.

Peers, each in its own process (``bench.audit_peers``) so every peak RSS is that peer's own:
  - export_stream vs load_list: the streaming signed export against the same events loaded into one
    list and serialized in memory; peak RSS above the process's baseline is the figure to compare;
  - verify: offline verification of the streamed bundle with only the public key;
  - append_chained vs insert_plain: events/s through ``AuditStore.append`` (head lock, HMAC and
    SHA-256 chain, one transaction each) against plain one-row INSERT transactions.
Seeding writes correctly chained rows in bulk so a 100k-event trail takes seconds, not minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import insert, update

from audit import chain
from audit.store import AuditStore, Head, now_ts
from audit.tables import audit_checkpoints, audit_events, audit_head
from bench.audit_peers import db_url
from bench.isolated import PeerFailed, run_isolated


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
    last = head.seq + num_events  # fixed up front: ``head`` advances inside the loop
    for start in range(head.seq + 1, last + 1, batch):
        rows, cps = [], []
        for seq in range(start, min(start + batch, last + 1)):
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


def _peer(name: str, work: Path, *args: object) -> dict[str, Any]:
    try:
        return run_isolated("bench.audit_peers", name, work, *args)
    except PeerFailed as e:
        raise RuntimeError(f"peer {name} failed:\n{e.stderr[-4000:]}") from None


async def _seed_fresh(work: Path, num_events: int) -> float:
    store = await AuditStore.open(db_url(work), work, create_tables=True)
    try:
        t0 = time.perf_counter()
        await seed(store, num_events)
        return time.perf_counter() - t0
    finally:
        await store.close()


def _ratios(peers: dict[str, dict[str, Any]]) -> dict[str, float]:
    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("inf")

    stream, naive = peers["export_stream"], peers["load_list"]
    return {
        "load_list / export_stream peak RSS delta": ratio(naive["peak_rss_delta_mib"],
                                                          stream["peak_rss_delta_mib"]),
        "load_list / export_stream peak RSS": ratio(naive["peak_rss_mib"], stream["peak_rss_mib"]),
        "insert_plain / append_chained events/s": ratio(peers["insert_plain"]["events_per_s"],
                                                        peers["append_chained"]["events_per_s"]),
    }


def run(num_events: int = 100_000, *, num_writes: int = 2000, workdir: Path | None = None) -> dict[str, Any]:
    """Seed a fresh SQLite audit trail of ``num_events``, run every peer, return results and ratios."""
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-audit-", dir=workdir) as tmp:
        work = Path(tmp)
        seed_s = asyncio.run(_seed_fresh(work, num_events))
        peers = {name: _peer(name, work) for name in ("load_list", "export_stream", "verify")}
        peers["append_chained"] = _peer("append_chained", work, num_writes)
        peers["insert_plain"] = _peer("insert_plain", work, num_writes)
    return {"num_events": num_events, "num_writes": num_writes, "seed_s": round(seed_s, 2),
            "database": "sqlite (WAL)", "peers": peers, "ratios": _ratios(peers)}


def format_table(result: dict[str, Any]) -> str:
    """The results as a Markdown table plus the ratios."""
    cols = ("num_events", "seconds", "events_per_s", "bytes_mib", "peak_rss_mib", "peak_rss_delta_mib")
    lines = ["| peer | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, row in result["peers"].items():
        lines.append(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    lines += ["", *(f"{k}: {v}x" for k, v in result["ratios"].items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-events", type=int, default=100_000)
    parser.add_argument("--num-writes", type=int, default=2000)
    args = parser.parse_args()
    print(format_table(run(args.num_events, num_writes=args.num_writes)))


if __name__ == "__main__":
    main()
