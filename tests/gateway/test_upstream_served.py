"""A model routed to an upstream pool of two real ``kvgate serve --insecure-http`` servers: the load is
shared, prefix affinity warms one replica's cache and never another tenant's, streams pass through
chunk by chunk, budgets and audit hold as for the built-in engine, and a replica killed mid-run fails
no request that had not started streaming."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from policies import Policy

from .conftest import open_gateway, tenant_events
from .upstreams import LOOPBACK, upstreams

# Longer than a few 16-token blocks of the real vocabulary, so a warm prefix shows in cached_tokens.
LONG = ("The committee reviewed the quarterly figures, the staffing plan and the schedule for the new "
        "warehouse in considerable detail, and then adjourned until the following Tuesday morning. ") * 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    with upstreams(tmp_path_factory.mktemp("upstreams"), tiny_model_dir, 2) as f:
        yield f


@pytest.fixture
async def front(tmp_path, sqlite_url, llm, fleet, tiny_model_dir):
    """A gateway (its own engine aside) whose models ``up`` (both replicas) and ``solo`` (the first)
    route to the fleet with the front's key there."""
    async for g in open_gateway(tmp_path, sqlite_url, llm, **LOOPBACK):
        g.db_url = sqlite_url
        for name, replicas in (("up", fleet.replicas), ("solo", fleet.replicas[:1])):
            route = {"kind": "kvgate", "urls": [u.base for u in replicas],
                     "upstream_model": tiny_model_dir.name, "tokenizer": str(tiny_model_dir),
                     "max_model_len": 2048, "health_interval_s": 0.5,
                     "open_s": 30}
            r = await g.client.put(f"/admin/v1/models/{name}", headers=g.admin(),
                                   json={"route": route, "api_key": fleet.front_key})
            assert r.status_code == 200, r.text
        yield g


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _served(front, name: str) -> list[int]:
    return [r.num_requests for r in front.runtime.routes.get(name).pool.replicas.replicas]


async def _chat(front, key, model="up", content="Say something.", **extra):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}
    return await front.client.post("/v1/chat/completions", json=body, headers=_auth(key))


async def _usage_rows(front, tenant_id):
    r = await front.client.get(f"/admin/v1/tenants/{tenant_id}/usage", headers=front.admin(),
                               params={"window": "day"})
    return r.json()


async def test_load_is_shared_and_settled_with_the_upstreams_usage(front, fleet):
    tid, key = await front.make_tenant(policy=Policy(prefix_cache_scope="request"))  # no affinity
    before = fleet.num_requests()
    replies = await asyncio.gather(*(_chat(front, key, content=f"Count to {i}.") for i in range(8)))
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies]
    after = fleet.num_requests()
    per_replica = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(per_replica) == 8 and min(per_replica) >= 1, per_replica  # both took a share
    usages = [r.json()["usage"] for r in replies]
    rows = await _usage_rows(front, tid)
    assert sum(r["num_requests"] for r in rows) == 8
    assert sum(r["total_tokens"] for r in rows) == sum(u["total_tokens"] for u in usages)
    body = replies[0].json()
    assert body["model"] == "up" and body["id"].startswith("chatcmpl-") and body["choices"][0]["message"]
    events = await tenant_events(front.db_url, front.settings.data_dir, tid)
    finished = [d for n, _, d in events if n == "request.finished"]
    assert len(finished) == 8 and sorted(d["num_completion_tokens"] for d in finished) == sorted(
        u["completion_tokens"] for u in usages)
    assert [n for n, _, _ in events].count("request.admitted") == 8


async def test_prefix_affinity_warms_one_replica_and_no_other_tenant(front):
    _, key_a = await front.make_tenant()
    _, key_b = await front.make_tenant()
    first = await _chat(front, key_a, content=LONG)
    seen = _served(front, "up")
    again = await _chat(front, key_a, content=LONG)
    assert again.status_code == 200
    # the same replica took it (affinity), and its cache was warm from the first
    moved = [a - b for a, b in zip(_served(front, "up"), seen, strict=True)]
    assert sorted(moved) == [0, 1]
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # another tenant, on the one replica that holds tenant A's blocks: nothing cached for it
    await _chat(front, key_a, model="solo", content=LONG)  # warm, if "up" chose the other replica
    solo_a = await _chat(front, key_a, model="solo", content=LONG)
    solo_b = await _chat(front, key_b, model="solo", content=LONG)
    assert solo_a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert solo_b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_stream_passes_through_and_usage_is_stripped_unless_asked(front):
    tid, key = await front.make_tenant()
    body = {"model": "up", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
            "stream": True}
    for include_usage in (False, True):
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        async with front.client.stream("POST", "/v1/chat/completions", json=body | extra,
                                       headers=_auth(key)) as r:
            assert r.status_code == 200
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert len(content) >= 3  # chunk by chunk, not gathered
        assert all(c["model"] == "up" and c["id"] == chunks[0]["id"] for c in chunks)
        with_usage = [c for c in chunks if c.get("usage")]
        if include_usage:
            assert len(with_usage) == 1 and with_usage[0]["choices"] == []
            assert with_usage[0]["usage"]["completion_tokens"] == 12
        else:
            assert with_usage == [] and all("usage" not in c for c in chunks)
    rows = await _usage_rows(front, tid)
    assert sum(r["completion_tokens"] for r in rows) == 24


async def test_text_completions_and_upstream_refusals(front, fleet, tiny_model_dir):
    tid, key = await front.make_tenant()
    body = {"model": "up", "prompt": "Once upon a time", "max_tokens": 5}
    r = await front.client.post("/v1/completions", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-") and reply["model"] == "up"
    assert reply["usage"]["completion_tokens"] == 5 and reply["choices"][0]["finish_reason"] == "length"
    # a route whose upstream model or key is wrong is the operator's fault: 503, never the client's 4xx
    for name, model, api_key in (("wrong-model", "nope", fleet.front_key), ("wrong-key", None, "kvg_a_b")):
        route = {"kind": "kvgate", "urls": [fleet.replicas[0].base], "tokenizer": str(tiny_model_dir),
                 "upstream_model": model or tiny_model_dir.name, "max_model_len": 2048}
        r = await front.client.put(f"/admin/v1/models/{name}", headers=front.admin(),
                                   json={"route": route, "api_key": api_key})
        assert r.status_code == 200
        r = await _chat(front, key, model=name)
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
        assert r.headers["retry-after"]


async def test_budgets_hold_and_client_salts_are_refused(front):
    tid, key = await front.make_tenant(policy=Policy(daily_token_quota=150, max_output_tokens=8))
    r = await _chat(front, key, content="word " * 60)
    assert r.status_code == 200, r.text
    r = await _chat(front, key, content="word " * 60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    r = await _chat(front, key, content="hi", cache_salt="mine")
    assert r.status_code == 400 and r.json()["error"]["code"] == "cache_salt_not_allowed"
    r = await _chat(front, key, model="nope")
    assert r.status_code == 404
    names = [n for n, _, _ in await tenant_events(front.db_url, front.settings.data_dir, tid)]
    assert names.count("request.finished") == 1 and names.count("request.rejected") == 3


async def test_a_replica_killed_mid_run_fails_no_request_that_had_not_started_streaming(front, fleet):
    """Last in the module: it kills the second replica."""
    _, key = await front.make_tenant(policy=Policy(prefix_cache_scope="request"))
    body = {"model": "up", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 48,
            "stream": True, "ignore_eos": True}

    async def one() -> tuple[bool, bool]:
        """(whether it completed, whether any content arrived before it ended)."""
        got_content = False
        async with front.client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(key)) as r:
            if r.status_code != 200:
                return False, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return True, got_content
                if line.startswith("data: ") and '"content"' in line:
                    got_content = True
        return False, got_content

    tasks = [asyncio.create_task(one()) for _ in range(12)]
    await asyncio.sleep(0.5)
    fleet.replicas[1].kill()
    tasks += [asyncio.create_task(one()) for _ in range(6)]  # sent after the kill, before health notices
    results = await asyncio.gather(*tasks)
    failed = [r for r in results if not r[0]]
    assert all(got for _, got in failed), results  # every failure had started streaming
    assert len(failed) < len(results)
    again = await asyncio.gather(*(one() for _ in range(4)))
    assert all(ok for ok, _ in again)
