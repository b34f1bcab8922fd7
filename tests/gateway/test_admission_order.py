"""Admission checks the cheap limits first: a request refused by the tenant's rate or concurrency limit,
or by the prompt byte cap, is answered without its prompt being tokenized, and whatever refuses a request
after the gate gives its place back."""

import asyncio
import threading

import pytest

from gateway.errors import QuotaExceeded
from gateway.inference.prompt_tokens import TokenizePool, longest_token_bytes
from policies import Policy

from .asgi_calls import call_app, on_app_loop
from .conftest import open_gateway
from .test_hot_path import _fail_store_on, _minute_usage

HUGE = "word " * 60_000  # 300 KB: more bytes than the tiny model's 2048 tokens can hold


class _CountingBackend:
    """The tokenizer's own Rust backend, counting what it is asked to encode (and by which thread)."""

    def __init__(self, inner):
        self._inner = inner
        self.num_encodes = 0
        self.threads: set[str] = set()

    def encode(self, *args, **kwargs):
        self.num_encodes += 1
        self.threads.add(threading.current_thread().name)
        return self._inner.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self.num_encodes += 1
        return self._inner.encode_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture
def counted(llm, monkeypatch):
    """Count every encode and chat-template rendering of the runtime's real tokenizer."""
    tokenizer = llm.tokenizer
    backend = _CountingBackend(tokenizer._tokenizer)
    monkeypatch.setattr(tokenizer, "_tokenizer", backend)
    render = tokenizer.apply_chat_template

    def counting_render(*args, **kwargs):
        backend.num_encodes += 1
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting_render)
    return backend


def _bearer(key):
    return {"Authorization": f"Bearer {key}"}


def _chat_body(model, content, max_tokens=2, stream=False):
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}


def _chat(gw, key, content, max_tokens=2, **extra):
    body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}
    return gw.client.post("/v1/chat/completions", headers=_bearer(key), json=body)


def _complete(gw, key, prompt, max_tokens=2):
    body = {"model": gw.runtime.engine.model_name, "prompt": prompt, "max_tokens": max_tokens}
    return gw.client.post("/v1/completions", headers=_bearer(key), json=body)


def _error(r, status, code):
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]


async def test_a_tenant_at_its_request_rate_is_refused_before_tokenizing(tmp_path, db_url, llm, counted):
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(requests_per_minute=1))
        assert (await _chat(gw, key, "hello there")).status_code == 200
        assert counted.num_encodes > 0  # the counting sees a normal request's tokenizing
        counted.num_encodes = 0
        r = await _chat(gw, key, HUGE)
        _error(r, 429, "rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert counted.num_encodes == 0
        assert gw.runtime.quota.gate.num_in_flight(tid) == 0


async def _huge_during_a_stream(gw, key, counted):
    """A huge prompt sent while a streamed response is open; returns (its reply, the encodes it cost,
    the stream's reply)."""
    model, started, hold_open = gw.runtime.engine.model_name, asyncio.Event(), asyncio.Event()
    stream = asyncio.ensure_future(call_app(gw.client.app, key, _chat_body(model, "hi", 16, True),
                                            started=started, hold_open=hold_open))
    await started.wait()  # its first chunk is being sent: it holds the tenant's one slot
    counted.num_encodes = 0
    refused = await call_app(gw.client.app, key, _chat_body(model, HUGE))
    num_encodes = counted.num_encodes
    hold_open.set()
    return refused, num_encodes, await stream


async def test_a_tenant_at_its_concurrency_is_refused_before_tokenizing(tmp_path, db_url, llm, counted):
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(max_concurrent_requests=1))
        refused, num_encodes, streamed = await on_app_loop(gw, _huge_during_a_stream, gw, key, counted)
        assert refused.status == 429 and refused.json()["error"]["code"] == "concurrency_limit"
        assert num_encodes == 0
        assert streamed.status == 200 and streamed.body.endswith(b"data: [DONE]\n\n")
        assert gw.runtime.quota.gate.num_in_flight(tid) == 0
        assert (await _chat(gw, key, "again")).status_code == 200


async def test_a_prompt_over_the_byte_cap_is_refused_unread(tmp_path, sqlite_url, llm, counted):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant()
        counted.num_encodes = 0
        for r in (await _chat(gw, key, HUGE), await _complete(gw, key, HUGE)):
            error = _error(r, 400, "context_length_exceeded")
            assert error["type"] == "invalid_request_error" and "bytes" in error["message"]
        assert counted.num_encodes == 0
        assert await _minute_usage(gw, tid) == []  # nothing reserved


async def test_the_byte_cap_admits_every_prompt_that_fits(tmp_path, sqlite_url, llm):
    """The default cap is the tokenizer's longest token per allowed token, so even a prompt made of that
    token (81 bytes each) passes it when it fits; a cap of 16 bytes per token would refuse it."""
    tokenizer = llm.tokenizer
    longest = longest_token_bytes(tokenizer)
    piece = "\n" + " " * (longest - 1)
    assert len(tokenizer(piece, add_special_tokens=False)["input_ids"]) == 1
    prompt = piece * 50
    num_tokens = len(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    limit = 64
    assert num_tokens <= limit < len(prompt.encode()) // 16
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        _, key = await gw.make_tenant(policy=Policy(max_prompt_tokens=limit))
        r = await _complete(gw, key, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == num_tokens


async def test_long_prompts_are_tokenized_off_the_event_loop(tmp_path, sqlite_url, llm, counted):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        _, key = await gw.make_tenant()
        counted.threads.clear()
        assert (await _chat(gw, key, "hello " * 2000)).status_code == 200  # 12 KB, ~2000 tokens
        assert counted.threads and all(t.startswith("kvgate-tokenize") for t in counted.threads)


async def test_refusals_after_the_gate_leave_no_slot_taken(tmp_path, db_url, llm, monkeypatch):
    """One request at a time: each refusal below comes after the gate took the request's slot; a slot
    left taken would refuse the next request (and the gate's count shows it)."""
    async for gw in open_gateway(tmp_path, db_url, llm):
        policy = Policy(max_concurrent_requests=1, max_prompt_tokens=64, tokens_per_minute=1000)
        tid, key = await gw.make_tenant(policy=policy)
        refusals = [
            (_chat, HUGE, 2, 400, "context_length_exceeded"),  # the byte cap
            (_complete, [50_000], 2, 400, None),  # tokenizing (an id outside the vocabulary)
            (_chat, "many words " * 100, 2, 400, "context_length_exceeded"),  # the policy
            (_chat, "hi", 2000, 429, "request_too_large"),  # the reservation
        ]
        for send, prompt, max_tokens, status, code in refusals:
            r = await send(gw, key, prompt, max_tokens)
            assert r.status_code == status, r.text
            assert code is None or r.json()["error"]["code"] == code
            assert gw.runtime.quota.gate.num_in_flight(tid) == 0
        with monkeypatch.context() as m:
            _fail_store_on(gw, m, "request.admitted")
            _error(await _chat(gw, key, "hi"), 503, "audit_unavailable")
        assert gw.runtime.quota.gate.num_in_flight(tid) == 0
        r = await _chat(gw, key, "hi")
        assert r.status_code == 200, r.text
        assert gw.runtime.quota.gate.num_in_flight(tid) == 0
        rows = await _minute_usage(gw, tid)  # the accepted request is settled as before
        assert sum(row["total_tokens"] for row in rows) == r.json()["usage"]["total_tokens"]


async def test_a_full_tokenizing_pool_refuses_at_once():
    pool = TokenizePool(num_threads=1, max_waiting=1)
    release = threading.Event()
    first = asyncio.ensure_future(pool.run(lambda: release.wait(30)))
    second = asyncio.ensure_future(pool.run(lambda: "queued"))
    await asyncio.sleep(0)
    with pytest.raises(QuotaExceeded) as refused:
        await pool.run(lambda: "refused")
    assert refused.value.code == "tokenizer_busy" and refused.value.headers["retry-after"] == "1"
    release.set()
    assert await first is True and await second == "queued"
    assert await pool.run(lambda: "room again") == "room again"


async def _second_while_tokenizing(gw, tid, key, entered, release):
    """A second long prompt sent while the first is being tokenized; returns (its reply, the tenant's
    requests past the gate then, the first's reply)."""
    model, long = gw.runtime.engine.model_name, "hello " * 2000
    first = asyncio.ensure_future(call_app(gw.client.app, key, _chat_body(model, long)))
    try:
        assert await asyncio.to_thread(entered.wait, 30)  # on the pool's one thread
        refused = await call_app(gw.client.app, key, _chat_body(model, long + "again"))
        num_in_flight = gw.runtime.quota.gate.num_in_flight(tid)
    finally:
        release.set()
    return refused, num_in_flight, await first


async def test_a_full_tokenizing_pool_is_a_429_that_gives_the_slot_back(tmp_path, sqlite_url, llm, counted):
    entered, release = threading.Event(), threading.Event()
    encode = counted.encode

    def blocking_encode(*args, **kwargs):
        entered.set()
        release.wait(30)
        return encode(*args, **kwargs)

    counted.encode = blocking_encode
    async for gw in open_gateway(tmp_path, sqlite_url, llm, tokenize_threads=1, tokenize_queue=0):
        tid, key = await gw.make_tenant()
        refused, num_in_flight, first = await on_app_loop(
            gw, _second_while_tokenizing, gw, tid, key, entered, release)
        assert refused.status == 429 and refused.json()["error"]["code"] == "tokenizer_busy"
        assert refused.headers["retry-after"] == "1"
        assert num_in_flight == 1  # only the request being tokenized holds its place
        assert first.status == 200
        assert gw.runtime.quota.gate.num_in_flight(tid) == 0
