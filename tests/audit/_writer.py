"""Child-process writer for the concurrency tests (spawned, so it must be importable)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from audit.events import REQUEST_FINISHED, make_event
from audit.keys import load_or_create_keys
from audit.store import AuditStore, make_audit_engine


async def _write(url: str, data_dir: str, writer: str, num_tasks: int, num_events: int, barrier: Any) -> None:
    store = AuditStore(make_audit_engine(url), load_or_create_keys(Path(data_dir)), checkpoint_every=7,
                       owns_engine=True)
    await store.start()
    barrier.wait(timeout=60)  # both processes are connected and start appending together

    async def task(t: int) -> None:
        for i in range(num_events):
            await store.append(make_event(REQUEST_FINISHED, tenant_id=writer, request_id=f"{writer}-{t}-{i}",
                                          model="m", num_prompt_tokens=i))
            # Leave the write lock free now and then: SQLite's busy handler sleeps, so a process that
            # appends back to back can keep the other out until it is done, and nothing interleaves.
            await asyncio.sleep(0.02)

    await asyncio.gather(*(task(t) for t in range(num_tasks)))
    await store.close()


def write_events(url: str, data_dir: str, writer: str, num_tasks: int, num_events: int, barrier: Any) -> None:
    asyncio.run(_write(url, data_dir, writer, num_tasks, num_events, barrier))
