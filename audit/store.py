"""Append-only audit store on SQLAlchemy async Core: serialized appends, checkpoints, reads."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3  # audit.prepared runs SQLite statements on the raw cursor: its errors are unwrapped
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Connection, bindparam, func, insert, select, update
from sqlalchemy import event as sa_event
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from audit import chain
from audit.events import AuditEvent, make_event
from audit.keys import AuditKeys, load_or_create_keys
from audit.patterns import scrub_text
from audit.prepared import execute, execute_many
from audit.scrubbing import redact_event, redact_off_loop
from audit.tables import audit_checkpoints, audit_events, audit_head, metadata

DEFAULT_CHECKPOINT_EVERY = 1000
# Built once: constructing a DML statement (and its cache key) costs more than executing it on SQLite.
_INSERT_EVENT = insert(audit_events)
_LOCK_HEAD = update(audit_head).where(audit_head.c.id == 1).values(
    num_writes=audit_head.c.num_writes + 1).returning(
    audit_head.c.seq, audit_head.c.link, audit_head.c.chain_hash)
_ADVANCE_HEAD = update(audit_head).where(audit_head.c.id == 1).values(
    seq=bindparam("new_seq"), link=bindparam("new_link"), chain_hash=bindparam("new_chain_hash"))
_RECORD_COLUMNS = (*chain.CANONICAL_FIELDS, "link", "chain_hash")


class AuditUnavailable(RuntimeError):
    """The audit store could not record an event; the caller must fail closed (HTTP 503)."""


@dataclass(frozen=True, slots=True)
class Head:
    seq: int
    link: str
    chain_hash: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    seq: int
    link: str
    chain_hash: str
    created_at: str
    signature: str

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "link": self.link, "chain_hash": self.chain_hash,
                "created_at": self.created_at, "signature": self.signature}


def format_ts(dt: datetime) -> str:
    """Fixed-width ISO-8601 UTC, so stored timestamps sort as strings."""
    return dt.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def now_ts() -> str:
    return format_ts(datetime.now(UTC))


@contextmanager
def fail_closed(operation: str) -> Iterator[None]:
    """Turn the database's and the network's errors inside the block into ``AuditUnavailable``.

    Every reader and writer of the store runs its statements inside one, so callers fail closed on a
    single exception type whose message names ``operation`` and never the statement's parameters.
    """
    try:
        yield
    except (TimeoutError, sa_exc.DBAPIError, sa_exc.InterfaceError, sqlite3.Error, OSError,
            ConnectionError) as e:
        detail = scrub_text(str(getattr(e, "orig", e)).splitlines()[0] if str(e) else "")
        raise AuditUnavailable(f"audit store unavailable ({operation}): {type(e).__name__}: {detail}") from e


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_audit_engine(url: str) -> AsyncEngine:
    """An engine for stand-alone use (CLI, tests); the gateway passes its own instead."""
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30})
        sa_event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    return create_async_engine(url, pool_pre_ping=True)


class AuditStore:
    """The audit trail. One instance per process; any number of processes may share one database."""

    def __init__(self, engine: AsyncEngine, keys: AuditKeys, *,
                 checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, owns_engine: bool = False) -> None:
        if checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        self.engine = engine
        self.keys = keys
        self.checkpoint_every = checkpoint_every
        self._owns_engine = owns_engine
        # Appends in one process queue here instead of spinning on the database lock.
        self._local_lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str, data_dir: Path, *, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
                   create_tables: bool = False) -> AuditStore:
        store = cls(make_audit_engine(url), load_or_create_keys(data_dir),
                    checkpoint_every=checkpoint_every, owns_engine=True)
        await store.start(create_tables=create_tables)
        return store

    async def start(self, *, create_tables: bool = False) -> None:
        """Ensure the head row exists (tables come from migration 0002 unless ``create_tables``)."""
        with fail_closed("start"):
            if create_tables:
                async with self.engine.begin() as conn:
                    await conn.run_sync(metadata.create_all)
            try:
                async with self.engine.begin() as conn:
                    if (await conn.execute(select(audit_head.c.id))).first() is None:
                        await conn.execute(insert(audit_head).values(
                            id=1, seq=0, link=chain.GENESIS, chain_hash=chain.GENESIS, num_writes=0))
            except sa_exc.IntegrityError:
                pass  # another process created it first

    async def close(self) -> None:
        """Checkpoint the head (the shutdown checkpoint) and release an owned engine."""
        try:
            await self.checkpoint()
        finally:
            if self._owns_engine:
                await self.engine.dispose()

    async def append(self, event: AuditEvent, *, conn: AsyncConnection | None = None) -> Head:
        """Chain and store one event; inside ``conn``'s transaction when given.

        Raises:
            AuditUnavailable: The store could not be written; nothing was recorded.
        """
        event = await redact_off_loop(event)
        with fail_closed("append"):
            if conn is not None:
                return await conn.run_sync(self.append_sync, event)
            async with self._local_lock, self.engine.begin() as own:
                return await own.run_sync(self.append_sync, event)

    def append_sync(self, conn: Connection, event: AuditEvent) -> Head:
        """Chain and store one event inside the caller's synchronous transaction (it commits or rolls
        back with the caller's other writes). Database errors propagate unwrapped."""
        return self._append_all(conn, lock_head(conn), (event,))

    def append_many_sync(self, conn: Connection, events: Sequence[AuditEvent]) -> Head:
        """``append_sync`` for several events in order, with one lock and one update of the head for all
        of them (a request's admission records two)."""
        return self._append_all(conn, lock_head(conn), events)

    async def record(self, name: str, **fields: Any) -> Head:
        """``append(make_event(name, **fields))``."""
        return await self.append(make_event(name, **fields))

    def _append_all(self, conn: Connection, head: Head, events: Sequence[AuditEvent]) -> Head:
        """Chain ``events`` after ``head`` (locked by this transaction), store them and move the head."""
        rows, due = [], []
        for event in events:
            head, row = self._link(head, event)
            rows.append(row)
            if head.seq % self.checkpoint_every == 0:
                due.append(head)
        execute_many(conn, _INSERT_EVENT, rows)
        execute(conn, _ADVANCE_HEAD, {"new_seq": head.seq, "new_link": head.link,
                                      "new_chain_hash": head.chain_hash})
        for checkpointed in due:
            self._insert_checkpoint(conn, checkpointed)
        return head

    def _link(self, head: Head, event: AuditEvent) -> tuple[Head, dict[str, Any]]:
        """The stored row of ``event`` chained after ``head``, and the head it makes."""
        seq = head.seq + 1
        record = self._new_record(seq, event)
        tenant_hex, body_hex, canonical = chain.link_record(record)
        link = chain.next_link(head.link, tenant_hex, body_hex)
        chain_hash = chain.next_chain_hash(self.keys.chain_key, head.chain_hash, canonical)
        row = {**record, "data": chain.canonical_json(record["data"]).decode(), "link": link,
               "chain_hash": chain_hash}
        return Head(seq, link, chain_hash), row

    def _new_record(self, seq: int, event: AuditEvent) -> dict[str, Any]:
        event = redact_event(event)
        # The id columns are stored as given, never scrubbed: ids are the gateway's own, not secrets, and
        # a tenant-filtered export selects by them (a request whose prompt was its own tenant id once had
        # its events' tenant id replaced, and they vanished from that tenant's export).
        return {"seq": seq, "event_id": secrets.token_hex(16), "ts": now_ts(), "name": event.name,
                "tenant_id": event.tenant_id or None, "key_id": event.key_id or None,
                "request_id": event.request_id or None, "actor": event.actor or None, "data": event.data}

    def _insert_checkpoint(self, conn: Connection, head: Head) -> Checkpoint:
        created_at = now_ts()
        signature = self.keys.sign(chain.checkpoint_message(head.seq, head.link, head.chain_hash, created_at))
        cp = Checkpoint(head.seq, head.link, head.chain_hash, created_at, signature)
        conn.execute(insert(audit_checkpoints).values(**cp.as_dict()))
        return cp

    async def checkpoint(self) -> Checkpoint | None:
        """Sign the current head unless it is already checkpointed (or the chain is empty)."""
        with fail_closed("checkpoint"):
            async with self._local_lock, self.engine.begin() as conn:
                head = await conn.run_sync(lock_head)
                last = (await conn.execute(select(func.max(audit_checkpoints.c.seq)))).scalar()
                if head.seq == 0 or (last is not None and last >= head.seq):
                    return None
                return await conn.run_sync(self._insert_checkpoint, head)

    async def head(self) -> Head:
        with fail_closed("head"):
            async with self.engine.connect() as conn:
                row = (await conn.execute(select(audit_head).where(audit_head.c.id == 1))).one()
                return Head(row.seq, row.link, row.chain_hash)

    async def iter_records(self, first_seq: int, last_seq: int, *, batch: int = 1000,
                           ) -> AsyncIterator[dict[str, Any]]:
        """Stored events ``first_seq..last_seq`` in order, fetched in keyset pages (bounded memory)."""
        cursor = first_seq
        while cursor <= last_seq:
            with fail_closed("read"):
                async with self.engine.connect() as conn:
                    rows = (await conn.execute(select(audit_events).where(
                        audit_events.c.seq >= cursor, audit_events.c.seq <= last_seq,
                    ).order_by(audit_events.c.seq).limit(batch))).mappings().all()
            if not rows:
                return
            for row in rows:
                yield as_record(row)
            cursor = rows[-1]["seq"] + 1


def as_record(row: Any) -> dict[str, Any]:
    return {**{c: row[c] for c in _RECORD_COLUMNS}, "data": orjson.loads(row["data"])}


def lock_head(conn: Connection) -> Head:
    """Lock the chain's head row for ``conn``'s transaction and return it; writers of events call it first."""
    # The first statement is a write: PostgreSQL takes the row lock, SQLite takes its RESERVED (write)
    # lock at once, as BEGIN IMMEDIATE would. Concurrent writers wait here, so ``seq`` never forks.
    rows = execute(conn, _LOCK_HEAD)
    if not rows:
        raise AuditUnavailable("audit_head row missing: run migrations (0002_audit) or AuditStore.start()")
    return Head(*rows[0])
