"""What an upstream sends back is bounded: against a real misbehaving HTTP server, error and health bodies
are read only to a cap, event-stream lines and replies have caps, a reply has a total deadline that
keepalive comments do not extend, choice indexes and usage are held to what the request asked for, and
neither a full connection pool nor a busy replica's 503 or 429 opens a replica's breaker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import orjson
import pytest

from .bad_upstream import BadUpstream, Seen, chunk, head, ok_reply, send_events, send_forever
from .conftest import open_gateway
from .upstreams import LOOPBACK

CHAT = "/v1/chat/completions"
PAD = b"a" * 65_536
LINE_CAP = 65_536
BOUND_S = 15  # generous: each bound here acts within about 2 s


@pytest.fixture
async def gw(tmp_path, sqlite_url, llm):
    async for g in open_gateway(tmp_path, sqlite_url, llm, upstream_max_line_bytes=LINE_CAP, **LOOPBACK):
        yield g


async def _route(gw, bad: BadUpstream, tiny_model_dir, name: str = "bad", **extra) -> None:
    route = {"kind": "vllm", "urls": [bad.base], "tokenizer": str(tiny_model_dir), "max_model_len": 2048,
             "health_interval_s": 3600, **extra}
    r = await gw.client.put(f"/admin/v1/models/{name}", headers=gw.admin(), json={"route": route})
    assert r.status_code == 200, r.text


def _body(stream: bool, **extra) -> dict:
    return {"model": "bad", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "stream": stream, **extra}


async def _stream_events(gw, key: str, **extra) -> list[dict]:
    """The streamed reply's events (``[DONE]`` as a string), within the bound."""
    started = time.monotonic()
    async with gw.client.stream("POST", CHAT, json=_body(True, **extra),
                                headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        lines = [x[6:] async for x in r.aiter_lines() if x.startswith("data: ")]
    # measured, not a timeout: the test client holds this loop while the app answers
    assert time.monotonic() - started < BOUND_S
    return [x if x == "[DONE]" else orjson.loads(x) for x in lines]


async def _whole(gw, key: str, **extra) -> httpx.Response:
    started = time.monotonic()
    r = await gw.client.post(CHAT, json=_body(False, **extra), headers={"Authorization": f"Bearer {key}"})
    assert time.monotonic() - started < BOUND_S
    return r


def _replica(gw, name: str = "bad"):
    return gw.runtime.routes.get(name).pool.replicas.replicas[0]


async def test_an_endless_error_body_is_read_only_to_its_cap(gw, tiny_model_dir):
    async def refusal(req: Seen, w) -> None:
        await head(w, 400, "application/json")
        w.write(b'{"error": {"message": "bad request"}, "padding": "')
        await send_forever(w, PAD)

    with BadUpstream({CHAT: refusal}).serving() as bad:
        await _route(gw, bad, tiny_model_dir)
        _, key = await gw.make_tenant()
        r = await _whole(gw, key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "upstream_rejected", r.text


async def test_a_health_check_reads_the_status_and_never_the_body(gw, tiny_model_dir):
    async def endless_health(req: Seen, w) -> None:
        await head(w, 200, "application/json")
        await send_forever(w, PAD)

    with BadUpstream({"/health": endless_health}).serving() as bad:
        await _route(gw, bad, tiny_model_dir, health_interval_s=0.2, timeouts={"connect_s": 0.5})
        async with asyncio.timeout(BOUND_S):
            while len(bad.seen_at("/health")) < 4:
                await asyncio.sleep(0.1)
        # read whole, each check ran into its deadline (connect_s + 1) and called the replica down
        assert _replica(gw).is_healthy


@pytest.mark.parametrize("stream", [True, False])
async def test_a_line_over_the_cap_ends_the_reply(gw, tiny_model_dir, stream):
    async def endless_line(req: Seen, w) -> None:
        await head(w, 200)
        await send_events(w, chunk("Hi"))
        w.write(b'data: {"choices": [{"index": 0, "delta": {"content": "')
        await send_forever(w, PAD)

    with BadUpstream({CHAT: endless_line}).serving() as bad:
        await _route(gw, bad, tiny_model_dir)
        _, key = await gw.make_tenant()
        if stream:
            events = await _stream_events(gw, key)
            assert events[0]["choices"][0]["delta"]["content"] == "Hi"
            assert events[-1]["error"]["code"] == "upstream_unavailable", events
        else:
            r = await _whole(gw, key)
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"


async def test_keepalive_comments_do_not_hold_a_stream_past_its_idle_timeout(gw, tiny_model_dir):
    async def keepalives(req: Seen, w) -> None:
        await head(w, 200)
        await send_events(w, chunk("Hi"))
        await send_forever(w, b": keepalive\n\n", every_s=0.1)

    with BadUpstream({CHAT: keepalives}).serving() as bad:
        await _route(gw, bad, tiny_model_dir, timeouts={"idle_s": 1})
        _, key = await gw.make_tenant()
        events = await _stream_events(gw, key)
    assert events[0]["choices"][0]["delta"]["content"] == "Hi"
    assert events[-1]["error"]["code"] == "upstream_unavailable", events


@pytest.mark.parametrize("stream", [True, False])
async def test_a_reply_that_never_ends_meets_its_total_deadline(gw, tiny_model_dir, stream):
    async def trickle(req: Seen, w) -> None:
        await head(w, 200)
        with contextlib.suppress(ConnectionError):
            while not w.is_closing():  # a token every 0.1 s: never idle, never done
                await send_events(w, chunk("a"))
                await asyncio.sleep(0.1)

    with BadUpstream({CHAT: trickle}).serving() as bad:
        # a whole reply must be in within first_byte_s, a streamed one within total_s
        await _route(gw, bad, tiny_model_dir, timeouts={"first_byte_s": 1.5, "total_s": 1.5, "idle_s": 1})
        tid, key = await gw.make_tenant()
        if stream:
            events = await _stream_events(gw, key, max_tokens=1000)
            assert events[-1]["error"]["code"] == "upstream_unavailable"
            assert 5 <= len(events) <= 30
        else:
            r = await _whole(gw, key, max_tokens=1000)
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"


# index 1 with n=1 fails before the change too (a second choice appears); 10**9 built 10**9 objects
@pytest.mark.parametrize("where,index", [("choice", 1), ("choice", 1_000_000_000),
                                         ("tool_call", 5), ("tool_call", 1_000_000_000)])
@pytest.mark.parametrize("stream", [True, False])
async def test_an_index_beyond_the_request_is_refused(gw, tiny_model_dir, where, index, stream):
    if where == "choice":
        bad_chunk = chunk("x", index=index)
    else:
        call = {"index": index, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
        bad_chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}

    async def far_index(req: Seen, w) -> None:
        await head(w, 200)
        await send_events(w, chunk("Hi"), bad_chunk, chunk("", finish="stop"), "[DONE]")

    with BadUpstream({CHAT: far_index}).serving() as bad:
        await _route(gw, bad, tiny_model_dir)
        _, key = await gw.make_tenant()
        if stream:
            events = await _stream_events(gw, key)
            assert events[-1]["error"]["code"] == "upstream_unavailable", events
            assert all(c["index"] == 0 for e in events[:-1] for c in e["choices"])
        else:
            r = await _whole(gw, key)
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text


async def test_upstream_usage_is_billed_no_more_than_the_request_could_cost(gw, tiny_model_dir):
    async def inflated(req: Seen, w) -> None:
        await head(w, 200)
        usage = {"prompt_tokens": 10**9, "completion_tokens": 10**9, "total_tokens": 2 * 10**9,
                 "prompt_tokens_details": {"cached_tokens": 10**12}}
        await send_events(w, chunk("Hi", index=0), chunk("Yo", index=1, finish="stop"),
                          {"choices": [], "usage": usage}, "[DONE]")

    with BadUpstream({CHAT: inflated}).serving() as bad:
        await _route(gw, bad, tiny_model_dir)
        tid, key = await gw.make_tenant()
        r = await _whole(gw, key, n=2, max_tokens=3)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    num_prompt = usage["prompt_tokens"]
    assert 0 < num_prompt < 100 and usage["completion_tokens"] == 2 * 3
    assert usage["prompt_tokens_details"]["cached_tokens"] == num_prompt
    rows = (await gw.client.get(f"/admin/v1/tenants/{tid}/usage", headers=gw.admin())).json()
    assert sum(row["total_tokens"] for row in rows) == num_prompt + 6


async def test_a_full_connection_pool_is_not_the_replicas_failure(gw, tiny_model_dir):
    release = asyncio.Event()  # set on the server's loop

    async def held(req: Seen, w) -> None:
        await head(w, 200)
        await send_events(w, chunk("Hi"))
        await release.wait()
        await send_events(w, chunk("", finish="stop"), "[DONE]")

    with BadUpstream({CHAT: held}).serving() as bad:
        await _route(gw, bad, tiny_model_dir, max_connections=1, failures_to_open=1, health_interval_s=0.2,
                     timeouts={"connect_s": 0.5})
        _, key = await gw.make_tenant()

        async def first_request() -> httpx.Response:
            """On the app's own loop, so that it is in flight while the test client sends the next."""
            asgi = httpx.ASGITransport(app=gw.client.app)
            async with httpx.AsyncClient(transport=asgi, base_url="http://gw") as c:
                return await c.post(CHAT, json=_body(True), headers={"Authorization": f"Bearer {key}"})

        first = gw.client.blocking_portal.start_task_soon(first_request)  # it holds the one connection
        async with asyncio.timeout(BOUND_S):
            while not bad.seen_at(CHAT):
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # health checks meanwhile find no free connection: that is no verdict
        assert _replica(gw).is_healthy
        second = await _whole(gw, key)  # no connection free within connect_s
        assert second.status_code == 503 and second.json()["error"]["code"] == "upstream_unavailable"
        replica = _replica(gw)
        assert replica.state == "closed" and replica.num_failures == 0
        bad.run(_set(release))
        async with asyncio.timeout(BOUND_S):
            assert (await asyncio.wrap_future(first)).text.endswith("data: [DONE]\n\n")
            # A health check whose deadline passed while this test client held the app's loop (a loaded
            # machine) reads as a failed check; the next one, 0.2 s later, finds the replica again.
            while not _replica(gw).is_healthy:
                await asyncio.sleep(0.05)
        assert (await _whole(gw, key)).status_code == 200


async def _set(event: asyncio.Event) -> None:
    event.set()


@pytest.mark.parametrize("status", [503, 429])
async def test_a_busy_replica_keeps_its_breaker_closed(gw, tiny_model_dir, status):
    async def busy(req: Seen, w) -> None:
        await head(w, status, "application/json")
        w.write(b'{"error": {"message": "overloaded"}}')

    with BadUpstream({CHAT: busy}).serving() as bad:
        await _route(gw, bad, tiny_model_dir, failures_to_open=1)
        _, key = await gw.make_tenant()
        for _ in range(3):
            r = await _whole(gw, key)
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
        assert len(bad.seen_at(CHAT)) == 3  # each reached the replica: no breaker kept it out
        replica = _replica(gw)
        assert replica.state == "closed" and replica.num_failures == 0
        bad.replies[CHAT] = ok_reply  # and when it has room again, it answers
        assert (await _whole(gw, key)).status_code == 200
