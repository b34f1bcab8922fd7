"""Database-side chain check with the chain key: both the SHA-256 links and the HMAC chain."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select

from audit import chain
from audit.store import AuditStore, _fail_closed
from audit.tables import audit_checkpoints, audit_events


@dataclass(frozen=True, slots=True)
class ChainCheck:
    ok: bool
    num_events: int
    first_bad_seq: int | None = None
    reason: str | None = None


async def verify_store(store: AuditStore) -> ChainCheck:
    """Recompute every link and chain hash from the oldest retained anchor (genesis or purge cut)."""
    with _fail_closed("verify"):
        async with store.engine.connect() as conn:
            first = (await conn.execute(select(func.min(audit_events.c.seq)))).scalar()
            if first is None:
                return ChainCheck(True, 0)
            anchor = (await conn.execute(select(audit_checkpoints).where(audit_checkpoints.c.seq == first - 1)
                                         )).mappings().first()
            checkpoints = {r.seq: r for r in (await conn.execute(select(audit_checkpoints))).all()}
    if first > 1 and anchor is None:
        return ChainCheck(False, 0, first, "events before this were removed without a checkpoint")
    link, mac = (anchor["link"], anchor["chain_hash"]) if anchor else (chain.GENESIS, chain.GENESIS)
    expected, count = first, 0
    async for record in store.iter_records(first, 2**62):
        tenant_hex, body_hex, canonical = chain.link_record(record)
        link = chain.next_link(link, tenant_hex, body_hex)
        mac = chain.next_chain_hash(store.keys.chain_key, mac, canonical)
        if record["seq"] != expected:
            return ChainCheck(False, count, expected, "gap in sequence")
        if (record["link"], record["chain_hash"]) != (link, mac):
            return ChainCheck(False, count, expected, "event does not match its chain hashes")
        cp = checkpoints.get(expected)
        if cp is not None and (cp.link, cp.chain_hash) != (link, mac):
            return ChainCheck(False, count, expected, "chain does not match the signed checkpoint")
        expected, count = expected + 1, count + 1
    return ChainCheck(True, count)
