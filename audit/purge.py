"""Purging old events: a cut by sequence number, the signed checkpoint at it, the event recording it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from audit.events import AUDIT_PURGED, make_event, records_purge
from audit.store import AuditStore, Head, as_record, fail_closed, format_ts, lock_head
from audit.tables import audit_checkpoints, audit_events


@dataclass(frozen=True, slots=True)
class PurgeResult:
    """What a purge cut: the last deleted ``seq`` (``None`` when nothing was old enough) and how many."""

    cut_seq: int | None
    num_deleted: int


async def purge_before(store: AuditStore, before: datetime, *, actor: str | None = None) -> PurgeResult:
    """Delete the prefix of events older than ``before``, keeping a signed checkpoint at the cut.

    The cut is a sequence number: the events before the first one stamped at or after ``before``.
    Replicas stamp events with their own clocks, so timestamps need not grow with ``seq``; an event
    stamped old after a newer one is kept, with everything after it. The chain stays verifiable from
    the checkpoint, and the purge is recorded as an ``audit.purged`` event naming the cut.

    Raises:
        AuditUnavailable: The store could not be read or written; nothing was deleted.
    """
    with fail_closed("purge"):
        async with store._local_lock, store.engine.begin() as conn:
            head = await conn.run_sync(lock_head)
            cut = await _purge_cut(conn, format_ts(before))
            num_deleted, cut_hash = 0, None
            if cut is not None:
                cut_hash = await _ensure_checkpoint_at(store, conn, cut)
                result = await conn.execute(audit_events.delete().where(audit_events.c.seq <= cut))
                num_deleted = result.rowcount or 0
            # The event names the cut (seq and link): verifiers accept a chain that starts at a
            # checkpoint only when such an event follows it, so deleting old rows is not a purge.
            event = make_event(AUDIT_PURGED, actor=actor, before=format_ts(before), cut_seq=cut,
                               cut_hash=cut_hash, num_deleted=num_deleted)
            await conn.run_sync(store._append_all, head, (event,))
            return PurgeResult(cut, num_deleted)


async def _purge_cut(conn: AsyncConnection, before: str) -> int | None:
    """The last ``seq`` of the longest prefix of stored events all stamped before ``before``."""
    first_kept = (await conn.execute(select(func.min(audit_events.c.seq)).where(
        audit_events.c.ts >= before))).scalar()
    q = select(func.max(audit_events.c.seq))
    if first_kept is not None:
        q = q.where(audit_events.c.seq < first_kept)
    return (await conn.execute(q)).scalar()


async def _ensure_checkpoint_at(store: AuditStore, conn: AsyncConnection, seq: int) -> str:
    """The link at ``seq``, signed by a checkpoint there (made now unless one exists)."""
    cp = (await conn.execute(select(audit_checkpoints.c.link).where(
        audit_checkpoints.c.seq == seq))).first()
    if cp is not None:
        return str(cp.link)
    row = (await conn.execute(select(audit_events.c.link, audit_events.c.chain_hash).where(
        audit_events.c.seq == seq))).one()
    await conn.run_sync(store._insert_checkpoint, Head(seq, row.link, row.chain_hash))
    return str(row.link)


async def find_purge_record(conn: AsyncConnection, cut_seq: int, cut_hash: str) -> dict[str, Any] | None:
    """The stored ``audit.purged`` event recording a cut at ``cut_seq`` with link ``cut_hash``, if any."""
    rows = (await conn.execute(select(audit_events).where(
        audit_events.c.name == AUDIT_PURGED, audit_events.c.seq > cut_seq).order_by(audit_events.c.seq)
    )).mappings().all()
    return next((r for r in map(as_record, rows) if records_purge(r, cut_seq, cut_hash)), None)
