"""Completion requests against a real ``kvgate serve`` that record how each one ended, for the fault
tests: whole responses and streams from several tenants, kept coming until told to stop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from .served import Served

DEADLINE_S = 120.0
# A fixed KV pool (the tiny model's blocks are small; the default sizes it by memory) and no determinism
# mode whose kernels build at start-up.
SERVE_ARGS = ("--num-kv-blocks", "4096", "--determinism-modes", "fast")


@dataclass
class Outcome:
    """One request: its HTTP status, error code and Retry-After (errors), or its request id and usage
    (a whole answer, or a stream that ended with its usage chunk and ``[DONE]``)."""

    key: str
    is_stream: bool
    started: float
    ended: float = 0.0
    status: int = 0
    code: str | None = None
    retry_after: str | None = None
    request_id: str | None = None
    usage: dict | None = None
    is_done: bool = False  # a stream's [DONE] arrived
    events: int = 0

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and self.code is None and (self.is_done or not self.is_stream)


def client(server: Served, **kw: object) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=server.base, verify=str(server.ca), timeout=DEADLINE_S, limits=limits,
                             **kw)


def model_id(server: Served, key: str) -> str:
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.get(f"{server.base}/v1/models", verify=str(server.ca), headers=auth)
    return r.json()["data"][0]["id"]


def chat(model: str, max_tokens: int = 12, **fields: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Write about the sea."}],
            "max_tokens": max_tokens, "temperature": 1, **fields}


def _request_id(openai_id: str) -> str:
    return openai_id.split("-", 1)[1]


async def whole(c: httpx.AsyncClient, key: str, body: dict) -> Outcome:
    out = Outcome(key, False, time.monotonic())
    r = await c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    out.status = r.status_code
    data = r.json()
    if r.status_code == 200:
        out.request_id, out.usage = _request_id(data["id"]), data["usage"]
    else:
        out.code, out.retry_after = data["error"]["code"], r.headers.get("retry-after")
    return out


async def stream(c: httpx.AsyncClient, key: str, body: dict, on_chunk: Callable[[], Any] | None = None
                 ) -> Outcome:
    """``on_chunk()`` is called on each event that arrives."""
    out = Outcome(key, True, time.monotonic())
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    async with c.stream("POST", "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {key}"}) as r:
        out.status = r.status_code
        if r.status_code != 200:
            data = json.loads(await r.aread())
            out.code, out.retry_after = data["error"]["code"], r.headers.get("retry-after")
            return out
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.is_done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                out.events += 1
                if on_chunk is not None:
                    on_chunk()
                if "error" in event:
                    out.code = event["error"]["code"]
                else:
                    out.request_id = _request_id(event["id"])
                    out.usage = event.get("usage") or out.usage
    return out


@dataclass
class Load:
    """What the workers of ``keep_calling`` did: every finished request, and when each worker's current
    request started."""

    outcomes: list[Outcome]
    current: dict[int, float]

    def is_past(self, moment: float) -> bool:
        """Whether every request that was under way at ``moment`` has ended."""
        return all(started > moment for started in self.current.values())


async def keep_calling(c: httpx.AsyncClient, keys: list[str], body: dict, worker: int, load: Load,
                       stop: asyncio.Event) -> None:
    """Requests one after another (streams and whole answers in turn) until ``stop``; a 503 is retried
    after a short pause, as a client honouring Retry-After (shortened) would."""
    i = worker
    while not stop.is_set():
        key = keys[i % len(keys)]
        load.current[worker] = time.monotonic()
        out = await (stream if i % 2 else whole)(c, key, body)
        out.ended = time.monotonic()
        load.outcomes.append(out)
        i += 1
        load.current.pop(worker)
        if out.status == 503:
            await asyncio.sleep(0.25)


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def num_refused(outcomes: list[Outcome], code: str) -> int:
    """How many of ``outcomes`` were refused with a 503 ``code`` and a Retry-After; every other one must
    be a whole answer (never a 500, never a stream cut short)."""
    for out in outcomes:
        if out.status == 503:
            assert out.code == code and int(out.retry_after or 0) > 0, out
        else:
            assert out.is_ok, out
    return sum(out.status == 503 for out in outcomes)


async def through_a_fault(server: Served, keys: list[str], body: dict, num_workers: int, code: str,
                          cause: Callable[[], Any], heal: Callable[[], Any]) -> tuple[Load, float]:
    """Requests from ``num_workers`` clients; once each has had an answer, ``cause()`` (in a thread) a
    fault, until ``num_workers`` requests were refused with ``code`` and every request under way when it
    began has ended; then ``heal()`` it, until twice that many requests started since were answered.
    Returns the load and when causing the fault began."""
    load, stop = Load([], {}), asyncio.Event()
    async with client(server) as c:
        workers = [asyncio.create_task(keep_calling(c, keys, body, i, load, stop))
                   for i in range(num_workers)]
        try:
            await until(lambda: sum(o.is_ok for o in load.outcomes) >= num_workers, "answers")
            began = time.monotonic()  # before: causing it may take longer than a request (a checkpoint)
            await asyncio.to_thread(cause)
            await until(lambda: num_refused(load.outcomes, code) >= num_workers and load.is_past(began),
                        f"refusals with {code}")
            await asyncio.to_thread(heal)
            healed = time.monotonic()
            await until(lambda: sum(o.is_ok and o.started > healed for o in load.outcomes) >= 2 * num_workers,
                        "answers once the fault is over")
        finally:
            stop.set()
            await asyncio.gather(*workers)
    num_refused(load.outcomes, code)
    return load, began
