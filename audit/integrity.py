"""Database-side chain check with the chain key: both the SHA-256 links and the HMAC chain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from audit import chain
from audit.events import records_purge
from audit.store import AuditStore, Head, fail_closed
from audit.tables import audit_checkpoints, audit_events, audit_head


@dataclass(frozen=True, slots=True)
class ChainCheck:
    ok: bool
    num_events: int
    first_bad_seq: int | None = None
    reason: str | None = None


async def verify_store(store: AuditStore) -> ChainCheck:
    """Recompute every link and chain hash from the oldest retained anchor to the recorded head.

    The anchor is genesis, or the signed checkpoint at a purge's cut, which counts only when the
    retained chain holds the ``audit.purged`` event naming that cut (its seq and link): rows deleted
    from the start of the table are not a purge. The chain must end at the head the writers recorded,
    so rows deleted from the end are found too.
    """
    with fail_closed("verify"):
        async with store.engine.connect() as conn:
            # Checkpoints before the head: with writers appending meanwhile, every checkpoint read is
            # then at or before the head read, and the walk stops at that head.
            checkpoints = {r.seq: r for r in (await conn.execute(select(audit_checkpoints))).all()}
            row = (await conn.execute(select(audit_head).where(audit_head.c.id == 1))).one()
            head = Head(row.seq, row.link, row.chain_hash)
            first = (await conn.execute(select(func.min(audit_events.c.seq)))).scalar()
    if first is None:
        if head.seq == 0:
            return ChainCheck(True, 0)
        return ChainCheck(False, 0, head.seq, f"no events stored, but the head is at seq {head.seq}")
    anchor = checkpoints.get(first - 1)
    if first > 1 and anchor is None:
        return ChainCheck(False, 0, first, "events before this were removed without a checkpoint")
    return await _walk(store, first, anchor, checkpoints, head)


async def _walk(store: AuditStore, first: int, anchor: Any, checkpoints: dict[int, Any],
                head: Head) -> ChainCheck:
    link, mac = (anchor.link, anchor.chain_hash) if anchor is not None else (chain.GENESIS, chain.GENESIS)
    expected, is_purge_found = first, anchor is None
    async for record in store.iter_records(first, head.seq):
        count = expected - first
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
        is_purge_found = is_purge_found or records_purge(record, first - 1, anchor.link)
        expected += 1
    count = expected - first
    if (expected - 1, link, mac) != (head.seq, head.link, head.chain_hash):
        return ChainCheck(False, count, expected, f"chain ends at seq {expected - 1}, but the head is at "
                                                  f"seq {head.seq}: events at the end were deleted")
    if max(checkpoints, default=0) > head.seq:
        return ChainCheck(False, count, expected, "a signed checkpoint lies past the head: events at the "
                                                  "end were deleted")
    if not is_purge_found:
        return ChainCheck(False, count, first, f"the chain starts after seq {first - 1}, but no "
                                               f"audit.purged event records a purge there")
    return ChainCheck(True, count)
