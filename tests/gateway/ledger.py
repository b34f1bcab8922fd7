"""What a server left in its database after a fault, read back and checked: the audit chain verifies,
every admitted request was settled exactly once, the usage counters add up to the settlements, and no
concurrency slot is still held."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import func, select

from audit.integrity import verify_store
from audit.keys import load_or_create_keys
from audit.store import AuditStore
from audit.tables import audit_events
from gateway.storage.db import make_db_engine, normalize_db_url
from gateway.storage.models import TenantInFlight, UsageCounter

_U, _F = UsageCounter.__table__, TenantInFlight.__table__


@dataclass
class Ledger:
    """One tenant's requests as the database has them."""

    admitted: list[str] = field(default_factory=list)  # request ids of request.admitted, in chain order
    finished: dict[str, list[dict]] = field(default_factory=dict)  # request id -> its request.finished data
    num_requests: int = 0  # summed over the tenant's minute windows (each request counts in one)
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_in_flight: int = 0

    def check(self) -> None:
        """Every admitted request settled once, nothing else settled, and the counters agree."""
        twice = {rid: n for rid, n in Counter(self.admitted).items() if n > 1}
        assert not twice, f"admitted twice: {twice}"
        unsettled = [rid for rid in self.admitted if rid not in self.finished]
        assert not unsettled, f"{len(unsettled)} admitted requests never settled: {unsettled[:5]}"
        multiple = {rid: len(events) for rid, events in self.finished.items() if len(events) != 1}
        assert not multiple, f"settled more than once: {multiple}"
        stray = set(self.finished) - set(self.admitted)
        assert not stray, f"settled but never admitted: {sorted(stray)[:5]}"
        events = [events[0] for events in self.finished.values()]
        num_prompt = sum(e["num_prompt_tokens"] for e in events)
        num_completion = sum(e["num_completion_tokens"] for e in events)
        assert self.num_requests == len(self.admitted)
        assert (self.num_prompt_tokens, self.num_completion_tokens) == (num_prompt, num_completion)
        assert self.num_tokens == num_prompt + num_completion  # no reservation left in the counters
        assert self.num_in_flight == 0, f"{self.num_in_flight} concurrency slots still held"


async def _read(url: str, data_dir: Path, tenant_ids: list[str]) -> dict[str, Ledger]:
    store = AuditStore(make_db_engine(normalize_db_url(url), null_pool=True), load_or_create_keys(data_dir))
    try:
        check = await verify_store(store)
        assert check.ok, check
        ledgers = {tid: Ledger() for tid in tenant_ids}
        async with store.engine.connect() as conn:
            events = await conn.execute(
                select(audit_events.c.tenant_id, audit_events.c.name, audit_events.c.request_id,
                       audit_events.c.data)
                .where(audit_events.c.tenant_id.in_(tenant_ids),
                       audit_events.c.name.in_(("request.admitted", "request.finished")))
                .order_by(audit_events.c.seq))
            for tid, name, request_id, data in events:
                ledger = ledgers[tid]
                if name == "request.admitted":
                    ledger.admitted.append(request_id)
                else:
                    ledger.finished.setdefault(request_id, []).append(json.loads(data))
            sums = await conn.execute(
                select(_U.c.tenant_id, func.sum(_U.c.num_requests), func.sum(_U.c.num_tokens),
                       func.sum(_U.c.num_prompt_tokens), func.sum(_U.c.num_completion_tokens))
                .where(_U.c.tenant_id.in_(tenant_ids), _U.c.window == "minute").group_by(_U.c.tenant_id))
            for tid, *counts in sums:
                ledger = ledgers[tid]
                (ledger.num_requests, ledger.num_tokens, ledger.num_prompt_tokens,
                 ledger.num_completion_tokens) = (int(c) for c in counts)
            slots = await conn.execute(select(_F.c.tenant_id, func.sum(_F.c.num_in_flight))
                                       .where(_F.c.tenant_id.in_(tenant_ids)).group_by(_F.c.tenant_id))
            for tid, num in slots:
                ledgers[tid].num_in_flight = int(num)
    finally:
        await store.engine.dispose()
    return ledgers


def read_ledgers(url: str, data_dir: Path, tenant_ids: list[str]) -> dict[str, Ledger]:
    """Each tenant's ledger; asserts that the whole audit chain verifies."""
    return asyncio.run(_read(url, data_dir, tenant_ids))


def settled_ledgers(url: str, data_dir: Path, tenant_ids: list[str], timeout_s: float = 60.0
                    ) -> dict[str, Ledger]:
    """The ledgers once every tenant's slots are back (settlements still being retried may take a
    moment after the last response), each checked."""
    deadline = time.monotonic() + timeout_s
    while True:
        ledgers = read_ledgers(url, data_dir, tenant_ids)
        if all(ledger.num_in_flight == 0 for ledger in ledgers.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for ledger in ledgers.values():
        ledger.check()
    return ledgers


def check_answers(ledgers: dict[str, Ledger], answered: dict[str, dict]) -> None:
    """Every admitted request was answered, every answer (request id -> its usage) admitted, and each
    settled with the tokens its answer reported."""
    admitted = {rid for ledger in ledgers.values() for rid in ledger.admitted}
    assert admitted == set(answered)
    for ledger in ledgers.values():
        for rid, (event,) in ledger.finished.items():
            usage = answered[rid]
            assert (event["num_prompt_tokens"], event["num_completion_tokens"]) == (
                usage["prompt_tokens"], usage["completion_tokens"])
