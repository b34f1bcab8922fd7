"""A model routed to two real llama.cpp ``llama-server`` replicas (built by ``kvgate bench
build-llamacpp``; skipped with the reason when it is not): streams and whole replies pass through, usage
is settled with llama.cpp's own count, both replicas take requests, and its shared prompt cache is off
for every tenant but those allowed to share it."""

from __future__ import annotations

import asyncio

import pytest

from bench import llamacpp
from policies import Policy

from .conftest import open_gateway
from .upstreams import LOOPBACK

BINARY = llamacpp.find_binary("llama-server")
pytestmark = pytest.mark.skipif(BINARY is None, reason=llamacpp.missing_reason("llama-server"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    gguf = llamacpp.default_gguf()
    root = tmp_path_factory.mktemp("llamacpp")
    started = [llamacpp.LlamaServer(BINARY, gguf, root / f"server{i}.log", num_slots=2, ctx_per_slot=1024,
                                    threads=1) for i in range(2)]
    try:
        for s in started:
            s.start(timeout_s=300)
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture
async def front(tmp_path, sqlite_url, llm, servers, default_model_dir):
    async for g in open_gateway(tmp_path, sqlite_url, llm, **LOOPBACK):
        for name, is_shared in (("llama", False), ("llama-shared", True)):
            route = {"kind": "llamacpp", "urls": [s.base_url for s in servers], "upstream_model": "smollm2",
                     "tokenizer": str(default_model_dir), "max_model_len": 1024, "shared_cache": is_shared}
            r = await g.client.put(f"/admin/v1/models/{name}", headers=g.admin(), json={"route": route})
            assert r.status_code == 200, r.text
        yield g


async def _chat(front, key, model, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "Name three primary colors."}],
            "max_tokens": 8, **extra}
    return await front.client.post("/v1/chat/completions", json=body, headers=_auth(key))


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_llama_server_replicas_answer_and_settle_with_their_usage(front):
    tid, key = await front.make_tenant(policy=Policy(prefix_cache_scope="request"))
    replicas = front.runtime.routes.get("llama").pool.replicas.replicas
    replies = list(await asyncio.gather(*(_chat(front, key, "llama") for _ in range(4))))
    # Without affinity (a request-scoped cache) the least loaded replica takes each request, ties at
    # random: four that happen to run one after another land on one replica one time in eight, so a few
    # more, each a coin flip, until both have served (all twenty on one: one time in 2^19)
    while min(r.num_requests for r in replicas) == 0 and len(replies) < 20:
        replies.append(await _chat(front, key, "llama"))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert min(r.num_requests for r in replicas) >= 1
    rows = (await front.client.get(f"/admin/v1/tenants/{tid}/usage", headers=front.admin())).json()
    assert sum(r["total_tokens"] for r in rows) == sum(r.json()["usage"]["total_tokens"] for r in replies)
    # the tokenizer is llama.cpp's model's own: the counts agree
    text = front.runtime.metrics.render().decode()
    assert 'kvgate_upstream_usage_disagreements_total{model="llama"}' not in text
    async with front.client.stream("POST", "/v1/chat/completions", headers=_auth(key),
                                   json={"model": "llama", "messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 6, "stream": True}) as r:
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 3


async def test_the_shared_cache_pool_is_only_for_tenants_allowed_to_share(front):
    _, plain = await front.make_tenant()
    _, sharer = await front.make_tenant(policy=Policy(allow_shared_upstream_cache=True))
    r = await _chat(front, plain, "llama-shared")
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert (await _chat(front, sharer, "llama-shared")).status_code == 200
