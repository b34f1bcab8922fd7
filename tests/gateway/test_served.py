"""A real ``kvgate serve`` under real use: large outputs, floods of streams, clients that stop reading or
leave, and an engine child that dies under load. Nothing may end in a 500 or take the engine down."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import time

import httpx
import pytest

from tests.gateway.served import SHARED_SERVE_ARGS, Served

pytestmark = pytest.mark.timeout(300)
PROMPT = " ".join(["The lighthouse keeper wrote down every ship that passed the rocks that winter."] * 25)


@pytest.fixture(scope="module")
def server(shared_server) -> Served:
    """The server test_faults_disconnects uses too (its 2 s stall timeout is for the clients here that stop
    reading): these tests read only their own tenants' counters and wait for the engine to idle, and the
    one that kills the engine child waits for it to come back."""
    return shared_server(*SHARED_SERVE_ARGS)


@pytest.fixture(scope="module")
def model(server: Served) -> str:
    key = server.make_key("model-probe")
    with _client(server, key) as c:
        return c.get("/v1/models").json()["data"][0]["id"]


def _client(server: Served, key: str, **kw) -> httpx.Client:
    return httpx.Client(base_url=server.base, verify=str(server.ca), timeout=120,
                        headers={"Authorization": f"Bearer {key}"}, **kw)


def _chat(model: str, content: str = "Tell me a story.", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def _metric(server: Served, name: str, **labels: str) -> float:
    with server.admin() as admin:
        text = admin.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_one_request_with_n_8_and_top_logprobs_20_is_answered(server: Served, model: str) -> None:
    key, other = server.make_key("big-output"), server.make_key("bystander")
    body = _chat(model, n=8, logprobs=True, top_logprobs=20, max_tokens=256, temperature=1)
    with _client(server, key) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 8
    num_tokens = 0
    for choice in out["choices"]:
        content = choice["logprobs"]["content"]
        assert content and all(len(t["top_logprobs"]) == 20 for t in content)
        num_tokens += len(content)
    assert out["usage"]["completion_tokens"] == num_tokens
    with _client(server, other) as c:  # the engine serves on, for everyone
        assert c.post("/v1/chat/completions", json=_chat(model, max_tokens=4)).status_code == 200


async def _stream(server: Served, key: str, body: dict,
                  started: list[str] | None = None) -> tuple[int, list[dict]]:
    """A streamed chat's status and events; ``started`` gets an entry when its first event arrives."""
    async with httpx.AsyncClient(base_url=server.base, verify=str(server.ca), timeout=180,
                                 headers={"Authorization": f"Bearer {key}"}) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if started is not None and len(events) == 1:
                        started.append(key)
            return r.status_code, events


def test_a_flood_of_streams_with_long_prompts_runs_clean(server: Served, model: str) -> None:
    keys = [server.make_key(f"flood-{i}") for i in range(4)]
    body = _chat(model, PROMPT, max_tokens=256, temperature=1)

    async def flood():
        return await asyncio.gather(*(_stream(server, keys[i % 4], body) for i in range(32)))

    results = asyncio.run(flood())
    for status, events in results:
        assert status == 200
        assert not any("error" in e for e in events), [e for e in events if "error" in e][:1]
        assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    with _client(server, keys[0]) as c:
        assert c.post("/v1/chat/completions", json=_chat(model, max_tokens=4)).status_code == 200


def _stalled_stream(server: Served, key: str, body: dict) -> ssl.SSLSocket:
    """Send a streaming request from a socket with a tiny receive buffer, then never read."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ctx = ssl.create_default_context(cafile=str(server.ca))
    sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    sock.connect(("127.0.0.1", int(server.base.rsplit(":", 1)[1])))
    payload = json.dumps(body | {"stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n")
    sock.sendall(head.encode() + payload)
    return sock


def test_clients_that_stop_reading_are_dropped_and_their_requests_settled(server: Served, model: str) -> None:
    tenant, key = server.make_tenant("stalled")
    body = _chat(model, max_tokens=1900, n=4, temperature=1, logprobs=True, top_logprobs=20)
    socks = [_stalled_stream(server, key, body) for _ in range(4)]
    try:
        # Each stream's chunks (~2 KB a token and choice with 20 alternatives, ~15 MB in all) fill the
        # socket buffers (the kernel's send buffer grows to 4 MB on Linux) long before the end: the server
        # must give up on them, abort their generation and settle them.
        _until(lambda: _metric(server, "kvgate_requests_total", tenant=tenant, status="aborted") == 4,
               timeout_s=120, what="the stalled streams to be aborted")
        assert _metric(server, "kvgate_requests_total", tenant=tenant, status="ok") == 0
        _until(lambda: _metric(server, "kvgate_engine_running_requests") == 0, what="the engine to idle")
        with _client(server, key) as c:  # and the server serves on
            assert c.post("/v1/chat/completions", json=_chat(model, max_tokens=4)).status_code == 200
    finally:
        for s in socks:
            s.close()


def test_a_whole_request_whose_client_leaves_is_aborted(server: Served, model: str) -> None:
    tenant, key = server.make_tenant("leaver")
    with _client(server, key) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json=_chat(model, PROMPT, n=8, max_tokens=1500, temperature=1),
               timeout=httpx.Timeout(60, read=1.0))
    _until(lambda: _metric(server, "kvgate_requests_total", tenant=tenant, status="aborted") == 1,
           timeout_s=30, what="the abandoned request to be aborted")
    assert _metric(server, "kvgate_requests_total", tenant=tenant, status="ok") == 0


def test_an_engine_killed_under_load_fails_its_requests_cleanly_and_comes_back(server: Served,
                                                                              model: str) -> None:
    key = server.make_key("crash")
    old_pid, log_start = server.engine_pid(), server.log_size()
    # ignore_eos: a sampled end-of-sequence would finish a request before all eight run, and the kill
    # below waits for eight.
    body = _chat(model, PROMPT, max_tokens=1500, temperature=1, ignore_eos=True)

    async def load():
        async with httpx.AsyncClient(base_url=server.base, verify=str(server.ca), timeout=120,
                                     headers={"Authorization": f"Bearer {key}"}) as c:
            wholes = [asyncio.ensure_future(c.post("/v1/chat/completions", json=body)) for _ in range(4)]
            started: list[str] = []  # streams whose first event came: their 200 is sent
            streams = [asyncio.ensure_future(_stream(server, key, body, started)) for _ in range(4)]
            deadline = time.monotonic() + 120
            while _metric(server, "kvgate_engine_running_requests") < 8 or len(started) < 4:
                assert time.monotonic() < deadline, "the eight requests never ran together"
                await asyncio.sleep(0.05)
            os.kill(old_pid, signal.SIGKILL)
            return await asyncio.gather(*wholes), await asyncio.gather(*streams)

    wholes, streams = asyncio.run(load())
    for r in wholes:
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_unavailable" and int(r.headers["retry-after"]) > 0
        assert "process" not in err["message"] and re.search(r"request \w+", err["message"])
    for status, events in streams:
        assert status == 200 and events[-1]["error"]["code"] == "engine_unavailable"
    ready = [httpx.get(f"{server.base}/readyz", verify=str(server.ca)).status_code]
    _until(lambda: ready.append(httpx.get(f"{server.base}/readyz", verify=str(server.ca)).status_code)
           or ready[-1] == 200, timeout_s=120, what="the engine to come back")
    assert ready[0] == 503  # not ready while the new child loads
    assert server.engine_pid() != old_pid
    with _client(server, key) as c:
        assert c.post("/v1/chat/completions", json=_chat(model, max_tokens=4)).status_code == 200
    assert "engine process lost" in server.log(log_start)
