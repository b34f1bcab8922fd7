"""Hundreds of streaming clients of a real ``kvgate serve`` leaving at random points: before their
answer starts, right after its head, after a few chunks, or at the end. Afterwards the engine holds no
sequence and no KV block, every place and concurrency slot is back, and every admitted request is
settled exactly once, with the tokens it really produced."""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time

import pytest

from .faultload import chat, client, model_id
from .ledger import settled_ledgers
from .served import SHARED_SERVE_ARGS, Served

pytestmark = pytest.mark.timeout(300)
NUM_REQUESTS = 200
NUM_AT_ONCE = 64  # within the engine's places (max_num_seqs + max_queued_requests): none is refused
MAX_TOKENS = 24
# How a client leaves: its share of the requests.
WAYS = {"unsent_answer": 0.1, "after_head": 0.1, "after_chunks": 0.7, "at_the_end": 0.1}
IDLE_GAUGES = ("kvgate_engine_running_requests", "kvgate_engine_waiting_requests",
               "kvgate_kv_cache_usage_ratio", "kvgate_admitted_requests")


def _gauges(server: Served) -> dict[str, float]:
    with server.admin() as admin:
        text = admin.get("/metrics").text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in IDLE_GAUGES:
            values[name] = float(value)
    return values


def _requests_total(server: Served, tenant_id: str) -> dict[str, float]:
    with server.admin() as admin:
        text = admin.get("/metrics").text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_requests_total{") and f'tenant="{tenant_id}"' in line:
            status = line.split('status="', 1)[1].split('"', 1)[0]
            totals[status] = totals.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def _leave_unanswered(server: Served, key: str, body: dict) -> None:
    """Send the whole request over a TLS connection of its own, then close it without reading."""
    host, port = server.base.removeprefix("https://").split(":")
    ctx = ssl.create_default_context(cafile=str(server.ca))
    reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
    payload = json.dumps(body | {"stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    writer.write(head.encode() + payload)
    await writer.drain()
    writer.close()


async def _leave(server: Served, c, key: str, body: dict, way: str, num_chunks: int) -> str:
    """One streaming request whose client leaves ``way``; returns what it saw last."""
    if way == "unsent_answer":
        await _leave_unanswered(server, key, body)
        return way
    async with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True},
                        headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        if way == "after_head":
            return way
        seen, last = 0, ""
        async for line in r.aiter_lines():
            assert not line.startswith('data: {"error"'), line  # an error event, not a token's text
            if line.startswith("data: "):
                seen, last = seen + 1, line
                if way == "after_chunks" and seen >= num_chunks:
                    return way  # the response is closed unread: httpx drops the connection
        assert last == "data: [DONE]", (way, seen, last)
    return way


async def _crowd(server: Served, keys: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    body = chat(model_id(server, keys[0]), max_tokens=MAX_TOKENS, ignore_eos=True)
    room = asyncio.Semaphore(NUM_AT_ONCE)
    ways = rng.choices(list(WAYS), weights=list(WAYS.values()), k=NUM_REQUESTS)
    # after_chunks: the role chunk, then about a token a chunk: cut anywhere before the end
    cuts = [rng.randint(1, MAX_TOKENS) for _ in range(NUM_REQUESTS)]

    async def one(i: int) -> str:
        async with room:
            return await _leave(server, c, keys[i % len(keys)], body, ways[i], cuts[i])

    async with client(server) as c:
        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


def _until_idle(server: Served, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while any((gauges := _gauges(server)).values()):
        assert time.monotonic() < deadline, gauges
        time.sleep(0.2)
    return gauges


def test_hundreds_of_streams_cut_at_random_leave_nothing_held_and_everything_settled(shared_server) -> None:
    # test_served's server: its tenants, counters and log lines since the start are this test's own
    server: Served = shared_server(*SHARED_SERVE_ARGS)
    log_start = server.log_size()
    tenants = [server.make_tenant(f"leavers-{i}") for i in range(4)]
    ways = asyncio.run(_crowd(server, [key for _, key in tenants], seed=20261126))
    assert sorted(set(ways)) == sorted(WAYS)
    assert set(_until_idle(server)) == set(IDLE_GAUGES)  # every gauge read, and each one 0
    ledgers = settled_ledgers(f"sqlite:///{server.data_dir / 'kvgate.db'}", server.data_dir,
                              [tid for tid, _ in tenants])
    for tid, _ in tenants:
        ledger, totals = ledgers[tid], _requests_total(server, tid)
        # each admitted request finished once, as the metrics saw it too; most were cut short
        assert totals.get("ok", 0) + totals.get("aborted", 0) == len(ledger.admitted), totals
        assert totals.get("aborted", 0) > 0
        events = [events[0] for events in ledger.finished.values()]
        assert all(e["num_completion_tokens"] <= MAX_TOKENS for e in events)
    assert "request.unhandled" not in server.log(log_start)
    # Only a request whose client left before the server read it may not have been admitted.
    num_admitted = sum(len(ledger.admitted) for ledger in ledgers.values())
    assert NUM_REQUESTS - ways.count("unsent_answer") <= num_admitted <= NUM_REQUESTS
