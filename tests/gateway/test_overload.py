"""Overload on a real ``kvgate serve``: past its places in the engine a request is refused at once (503, or
the tenant's own 429 first: over its own limits, or holding its share of the places), with a whole-second
``Retry-After``; within them it is served; and once the burst is over every place comes back."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.served import Served, serve

pytestmark = pytest.mark.timeout(600)
# One running sequence and one queued request: two places. The held streams' clients never read: neither
# deadline for such a client (the stream's stall, the connection's write) may end them during the test.
ARGS = ("--max-num-seqs", "1", "--num-kv-blocks", "1024", "--determinism-modes", "fast",
        "--stream-stall-timeout-s", "120", "--http-write-timeout-s", "120")
NUM_PLACES = 2
DRAIN_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVGATE_MAX_QUEUED_REQUESTS", str(NUM_PLACES - 1))
        with serve(tmp_path_factory.mktemp("overload"), tiny_model_dir, *ARGS) as s:
            yield s


def _metrics(server: Served) -> str:
    with server.admin() as admin:
        return admin.get("/metrics").text


def _gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


_REFUSED = re.compile(r'^kvgate_requests_total\{[^}]*status="503"[^}]*\} (\S+)$', re.M)


def _num_refused(text: str) -> float:
    return sum(float(v) for v in _REFUSED.findall(text))


def _wait_for(server: Served, admitted: int, *, is_idle: bool = False) -> str:
    """The metrics once ``admitted`` requests hold places (and the engine is idle, if asked)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        text = _metrics(server)
        engine = sum(_gauge(text, f"kvgate_engine_{k}_requests") for k in ("running", "waiting"))
        if _gauge(text, "kvgate_admitted_requests") == admitted and (not is_idle or engine == 0):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.2)


def _client(server: Served, key: str, **kw) -> httpx.AsyncClient:  # type: ignore[no-untyped-def]
    return httpx.AsyncClient(base_url=server.base, verify=str(server.ca), timeout=120,
                             headers={"Authorization": f"Bearer {key}"}, **kw)


def _chat(model: str, max_tokens: int, **extra) -> dict:  # type: ignore[no-untyped-def]
    return {"model": model, "messages": [{"role": "user", "content": "Tell me about lighthouses."}],
            "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def _post(client: httpx.AsyncClient, body: dict) -> httpx.Response:
    """One request, streamed or not, read to its end."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        await r.aread()
        return r


def _assert_refusal(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"]) == (code, "server_error" if status == 503 else "rate_limit_error")
    assert error["message"]
    retry_after = r.headers["retry-after"]
    assert retry_after.isdigit() and 1 <= int(retry_after) <= 60, retry_after


def _assert_served(r: httpx.Response, stream: bool) -> None:
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def model(server: Served) -> str:
    with httpx.Client(base_url=server.base, verify=str(server.ca),
                      headers={"Authorization": f"Bearer {server.make_key('probe')}"}) as c:
        return c.get("/v1/models").json()["data"][0]["id"]


async def _within_the_bound(server: Served, key: str, model: str) -> None:
    async with _client(server, key) as c:
        bodies = [_chat(model, 16), _chat(model, 16, stream=True)]
        for r, body in zip(await asyncio.gather(*(_post(c, b) for b in bodies)), bodies, strict=True):
            _assert_served(r, body.get("stream", False))


def test_requests_within_the_bound_are_served(server: Served, model: str) -> None:
    asyncio.run(_within_the_bound(server, server.make_key("within"), model))
    _wait_for(server, 0, is_idle=True)


async def _hold(server: Served, key: str, model: str) -> tuple[httpx.AsyncClient, asyncio.Task]:
    """A long stream with fat chunks (top_logprobs) to a client whose tiny receive buffer it never
    reads: it holds its place until the client leaves, however fast the engine is."""
    transport = httpx.AsyncHTTPTransport(
        verify=str(server.ca), socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    client = _client(server, key, transport=transport)
    body = _chat(model, 1800, stream=True, logprobs=True, top_logprobs=20)
    request = client.build_request("POST", "/v1/chat/completions", json=body)
    return client, asyncio.create_task(client.send(request, stream=True))


async def _burst_past_the_bound(server: Served, model: str) -> tuple[int, int]:
    """Every place held, one by a tenant at its concurrency limit and one by a tenant without limits: a
    burst of their requests and a third tenant's, streamed and not. Returns the 503s and 429s seen."""
    limited = server.make_key("limited", {"max_concurrent_requests": 1})
    free, other = server.make_key("free"), server.make_key("other")
    holds = [await _hold(server, limited, model), await _hold(server, free, model)]
    try:
        await asyncio.to_thread(_wait_for, server, NUM_PLACES)
        async with _client(server, free) as f, _client(server, limited) as lim, _client(server, other) as o:
            bodies = [_chat(model, 8, stream=bool(i % 2)) for i in range(8)]
            overloaded = await asyncio.gather(*(_post(o, b) for b in bodies))
            over_share = await asyncio.gather(*(_post(f, b) for b in bodies[:4]))
            over_own_limit = await asyncio.gather(*(_post(lim, b) for b in bodies[:4]))
    finally:
        for client, task in holds:  # the held streams' clients leave: their requests are aborted
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()
    for r in overloaded:  # a tenant holding no place: the server is full
        _assert_refusal(r, 503, "engine_overloaded")
    for r in over_share:  # holding its share (one of the two places) while others want one: its own use
        _assert_refusal(r, 429, "engine_share_exceeded")
    for r in over_own_limit:  # the tenant's own limit answers before the engine's
        _assert_refusal(r, 429, "concurrency_limit")
    return len(overloaded), len(over_share) + len(over_own_limit)


def test_past_the_bound_requests_are_refused_at_once_and_every_place_comes_back(server: Served,
                                                                                model: str) -> None:
    before = _num_refused(_metrics(server))
    num_503, _ = asyncio.run(_burst_past_the_bound(server, model))
    text = _wait_for(server, 0, is_idle=True)
    assert _num_refused(text) - before == num_503
    # Served again once the burst has drained.
    asyncio.run(_within_the_bound(server, server.make_key("after"), model))
    _wait_for(server, 0, is_idle=True)


async def _free_for_all(server: Served, model: str) -> list[tuple[httpx.Response, bool]]:
    keys = [server.make_key(f"crowd-{i}") for i in range(3)]
    clients = [_client(server, k) for k in keys]
    try:
        bodies = [_chat(model, 32, stream=bool(i % 2)) for i in range(18)]
        responses = await asyncio.gather(*(_post(clients[i % 3], b) for i, b in enumerate(bodies)))
    finally:
        for c in clients:
            await c.aclose()
    return [(r, bool(b.get("stream"))) for r, b in zip(responses, bodies, strict=True)]


def test_a_crowd_of_concurrent_clients_gets_answers_or_refusals_and_nothing_else(server: Served,
                                                                                 model: str) -> None:
    results = asyncio.run(_free_for_all(server, model))
    num_ok = 0
    for r, stream in results:
        if r.status_code == 503:
            _assert_refusal(r, 503, "engine_overloaded")
        elif r.status_code == 429:  # its tenant held its share of the places while another wanted one
            _assert_refusal(r, 429, "engine_share_exceeded")
        else:
            _assert_served(r, stream)
            num_ok += 1
    assert num_ok >= 1
    _wait_for(server, 0, is_idle=True)
