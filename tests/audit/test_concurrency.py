"""Concurrent writers (tasks and OS processes) keep one unforked chain on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
from sqlalchemy import select

from audit.events import REQUEST_FINISHED, make_event
from audit.integrity import verify_store
from audit.store import AuditStore
from audit.tables import audit_events
from tests.audit._writer import write_events

NUM_TASKS, NUM_EVENTS = 4, 20


def _run_two_processes(url: str, data_dir: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=write_events, args=(url, str(data_dir), w, NUM_TASKS, NUM_EVENTS, barrier))
             for w in ("proc-a", "proc-b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]


async def _assert_one_chain(url: str, data_dir: Path) -> None:
    store = await AuditStore.open(url, data_dir)
    try:
        check = await verify_store(store)
        total = 2 * NUM_TASKS * NUM_EVENTS
        assert check.ok and check.num_events == total, check
        async with store.engine.connect() as conn:
            writers = [r.tenant_id for r in (await conn.execute(
                select(audit_events.c.tenant_id).order_by(audit_events.c.seq))).all()]
        assert sorted(set(writers)) == ["proc-a", "proc-b"]
        switches = sum(a != b for a, b in zip(writers, writers[1:], strict=False))
        assert switches > 1, "the two processes never interleaved; the test did not exercise concurrency"
    finally:
        await store.close()


async def test_concurrent_tasks_one_process(store: AuditStore) -> None:
    async def task(t: int) -> None:
        for i in range(15):
            await store.append(make_event(REQUEST_FINISHED, tenant_id=f"t{t}", num_prompt_tokens=i))

    await asyncio.gather(*(task(t) for t in range(6)))
    check = await verify_store(store)
    assert check.ok and check.num_events == 90


async def test_two_processes_sqlite(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    init = await AuditStore.open(url, tmp_path, create_tables=True)
    await init.close()
    await asyncio.to_thread(_run_two_processes, url, tmp_path)
    await _assert_one_chain(url, tmp_path)


@pytest.mark.postgres
async def test_two_processes_postgres(pg_url: str, tmp_path: Path) -> None:
    init = await AuditStore.open(pg_url, tmp_path, create_tables=True)
    await init.close()
    await asyncio.to_thread(_run_two_processes, pg_url, tmp_path)
    await _assert_one_chain(pg_url, tmp_path)
