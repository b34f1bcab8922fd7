"""The completion endpoints' own ASGI plumbing: bounded body reads, replies, and a stream's settlement
however the stream ends (ran out, failed, client left, or never started)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import pytest
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from structlog.testing import capture_logs

import gateway.errors
from gateway.asgi_io import ClientGone, StreamReply, WholeReply, read_body, send_reply

from .conftest import open_gateway, tenant_events


def _receiver(*messages: dict):
    queue = list(messages)

    async def receive() -> dict:
        if not queue:
            await asyncio.Event().wait()  # like a server with nothing more to say
        return queue.pop(0)

    return receive


def _scope(headers: Sequence[tuple[bytes, bytes]] = ()) -> dict:
    return {"type": "http", "method": "POST", "headers": list(headers)}


def _body(chunk: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": chunk, "more_body": more}


async def test_read_body_joins_the_chunks():
    receive = _receiver(_body(b"ab", True), _body(b"", True), _body(b"cd", False))
    assert await read_body(_scope(), receive, 4) == b"abcd"
    assert await read_body(_scope(), _receiver(_body(b"", False)), 4) == b""


async def test_read_body_refuses_an_announced_oversize_body_before_reading():
    async def receive() -> dict:
        raise AssertionError("read a body announced as too large")

    with pytest.raises(RequestEntityTooLarge):
        await read_body(_scope([(b"content-length", b"5")]), receive, 4)


async def test_read_body_counts_what_arrives_not_what_is_announced():
    receive = _receiver(_body(b"abc", True), _body(b"de", False))
    with pytest.raises(RequestEntityTooLarge):
        await read_body(_scope([(b"content-length", b"3")]), receive, 4)


async def test_read_body_when_the_client_leaves():
    receive = _receiver(_body(b"ab", True), {"type": "http.disconnect"})
    with pytest.raises(ClientGone):
        await read_body(_scope(), receive, 100)


async def test_whole_reply_is_json_with_its_headers_and_waits_for_its_after_work():
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    after = asyncio.get_running_loop().create_future()
    replying = asyncio.ensure_future(
        send_reply(WholeReply({"a": [1, "é"]}, {"X-RateLimit-Limit-Requests": "5"}, after), _receiver(), send)
    )
    await asyncio.sleep(0.01)
    assert not replying.done()  # the body is out, the settlement is not done
    start, body = sent
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"x-ratelimit-limit-requests"] == b"5"
    assert int(headers[b"content-length"]) == len(body["body"])
    assert json.loads(body["body"]) == {"a": [1, "é"]} and body["more_body"] is False
    after.set_result(None)
    await replying


class _Chunks:
    """An SSE chunk source that records how it ended."""

    def __init__(self, chunks: list[bytes], then: str = "end") -> None:
        self.chunks, self.then = chunks, then
        self.is_closed = False
        self.num_finished = 0

    async def gen(self):
        try:
            for c in self.chunks:
                yield c
            if self.then == "fail":
                raise ValueError("boom")
            if self.then == "hang":
                await asyncio.Event().wait()
        finally:
            self.is_closed = True

    def reply(self) -> StreamReply:
        async def finish() -> None:
            self.num_finished += 1

        return StreamReply(self.gen(), {"cache-control": "no-cache"}, finish)


async def test_stream_reply_sends_every_chunk_then_settles():
    src, sent = _Chunks([b"data: 1\n\n", b"data: [DONE]\n\n"]), []

    async def send(message: dict) -> None:
        sent.append(message)

    await send_reply(src.reply(), _receiver(), send)
    assert dict(sent[0]["headers"])[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert sent[-1]["more_body"] is False
    assert src.is_closed and src.num_finished == 1


async def test_stream_reply_settles_when_its_chunks_fail():
    src = _Chunks([b"data: 1\n\n"], then="fail")

    async def send(message: dict) -> None:
        pass

    with pytest.raises(ValueError, match="boom"):
        await send_reply(src.reply(), _receiver(), send)
    assert src.is_closed and src.num_finished == 1


async def test_stream_reply_settles_when_the_client_leaves_mid_stream():
    src, sent = _Chunks([b"data: 1\n\n"], then="hang"), []

    async def send(message: dict) -> None:
        sent.append(message)

    receive = _receiver({"type": "http.disconnect"})
    await asyncio.wait_for(send_reply(src.reply(), receive, send), 5)
    assert src.is_closed and src.num_finished == 1
    assert not any(m.get("more_body") is False for m in sent)  # the stream was cut, not ended


async def test_stream_reply_settles_even_when_nothing_could_be_sent():
    src = _Chunks([b"data: 1\n\n"])

    async def send(message: dict) -> None:
        raise OSError("connection reset")

    with pytest.raises(OSError):
        await send_reply(src.reply(), _receiver(), send)
    assert src.num_finished == 1  # the generator never started, yet the request is settled


async def test_a_client_gone_before_its_body_is_answered_by_nobody(tmp_path, db_url, llm, caplog):
    """Nothing is admitted or reserved, nothing is sent, no error is logged (a 500 would log
    request.unhandled); the key was good, so its auth.success is recorded."""
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant()
        app, sent = gw.client.app, []
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "root_path": "", "query_string": b"", "headers": [(b"authorization", f"Bearer {key}".encode())],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {},
        }

        async def send(message: dict, sent: list = sent) -> None:
            sent.append(message)

        receive = _receiver(_body(b'{"model": ', True), {"type": "http.disconnect"})
        with caplog.at_level(logging.ERROR), capture_logs() as events:
            await asyncio.to_thread(gw.client.blocking_portal.call, app, scope, receive, send)
            gateway.errors.log.error("capture.probe")  # the logger a 500 goes to is captured here
        assert [e["event"] for e in events if e["log_level"] in ("error", "critical")] == ["capture.probe"]
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert sent == []
        r = await gw.client.get(f"/admin/v1/tenants/{tid}/usage?window=minute", headers=gw.admin())
        assert sum(row["num_requests"] for row in r.json()) == 0
        names = [name for name, _, _ in await tenant_events(db_url, tmp_path, tid)]
        assert names == ["auth.success"]
