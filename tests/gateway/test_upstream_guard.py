"""Who may change routes, and where they may send requests and keys: routes need their own scope, a key
is never sent to URLs it was not given for, private and metadata addresses are refused unless allowed
(when a route is stored, and again on every connection, so health tells nothing of the gateway's own
network), and servers that cannot keep a cache per tenant serve only tenants allowed to share one."""

from __future__ import annotations

import asyncio

import pytest

from gateway.clock import utcnow
from gateway.schemas.admin import POLICY_WRITE, ROUTES_WRITE
from gateway.schemas.routes import UpstreamRoute
from gateway.storage.models import ModelRoute
from gateway.tenancy import keys
from policies import Policy

from .bad_upstream import BadUpstream, ok_reply
from .conftest import open_gateway
from .upstreams import LOOPBACK

CHAT = "/v1/chat/completions"


@pytest.fixture
async def gw(tmp_path, sqlite_url, llm):
    async for g in open_gateway(tmp_path, sqlite_url, llm, **LOOPBACK):
        yield g


@pytest.fixture
async def strict(tmp_path, sqlite_url, llm):
    """A gateway with ``make serve``'s default: no private upstream addresses."""
    async for g in open_gateway(tmp_path, sqlite_url, llm):
        yield g


def _route(tiny_model_dir, urls, **extra) -> dict:
    return {"kind": "vllm", "urls": urls, "tokenizer": str(tiny_model_dir), "max_model_len": 2048, **extra}


async def _token(gw, *scopes: str) -> dict[str, str]:
    async with gw.runtime.sessionmaker() as s:
        token = await keys.create_admin_token(s, gw.runtime.hasher, "t", frozenset(scopes))
    return {"Authorization": f"Bearer {token}"}


async def _chat(gw, key: str, model: str):
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return await gw.client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})


async def test_routes_need_their_own_scope_not_policy_write(gw, tiny_model_dir):
    body = {"route": _route(tiny_model_dir, ["http://127.0.0.1:9"])}
    editor = await _token(gw, POLICY_WRITE)
    for r in (await gw.client.put("/admin/v1/models/m", headers=editor, json=body),
              await gw.client.delete("/admin/v1/models/m", headers=editor)):
        assert r.status_code == 403 and "routes:write" in r.json()["error"]["message"], r.text
    operator = await _token(gw, ROUTES_WRITE)
    assert (await gw.client.put("/admin/v1/models/m", headers=operator, json=body)).status_code == 200
    assert (await gw.client.delete("/admin/v1/models/m", headers=operator)).status_code == 200


async def test_the_key_is_dropped_when_the_urls_change_unless_given_again(gw, tiny_model_dir):
    with BadUpstream({}).serving() as first, BadUpstream({}).serving() as second:
        put = gw.client.put
        route = _route(tiny_model_dir, [first.base], health_interval_s=0.2)
        r = await put("/admin/v1/models/m", headers=gw.admin(), json={"route": route, "api_key": "sk-first"})
        assert r.json()["has_api_key"]
        r = await put("/admin/v1/models/m", headers=gw.admin(),
                      json={"route": route | {"affinity_blocks": 1}})
        assert r.json()["has_api_key"]  # the same URLs: kept
        moved = route | {"urls": [first.base, second.base]}
        r = await put("/admin/v1/models/m", headers=gw.admin(), json={"route": moved})
        assert r.status_code == 200 and not r.json()["has_api_key"]
        async with asyncio.timeout(15):
            while len(second.seen_at("/health")) < 3:
                await asyncio.sleep(0.1)
        assert first.seen_at("/health")[0].headers["authorization"] == "Bearer sk-first"
        assert all("authorization" not in s.headers for s in second.seen)
        r = await put("/admin/v1/models/m", headers=gw.admin(), json={"route": moved, "api_key": "sk-both"})
        assert r.json()["has_api_key"]  # given again, for the new URLs


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://10.1.2.3", "http://192.168.0.10:8000/v1", "http://172.16.0.1",
    "http://169.254.169.254", "http://100.100.100.200", "http://[::1]:8000", "http://[fe80::1]",
    "http://[fd00:ec2::254]", "http://[::ffff:127.0.0.1]", "http://[64:ff9b::a9fe:a9fe]", "http://0.0.0.0:80",
    "http://localhost:8000", "http://LOCALHOST.", "http://metadata.google.internal",
])
async def test_private_and_metadata_addresses_are_refused_by_default(strict, tiny_model_dir, url):
    r = await strict.client.put("/admin/v1/models/m", headers=strict.admin(),
                                json={"route": _route(tiny_model_dir, ["https://api.example.com", url])})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "upstream_address_refused" and error["param"] == "route.urls"


async def _store(gw, name: str, route: UpstreamRoute) -> None:
    """A route stored as one written before these checks was (no check on the way in)."""
    async with gw.runtime.sessionmaker() as s:
        s.add(ModelRoute(name=name, version=1, body=route.model_dump_json(), api_key_sealed=None,
                         is_deleted=False, changed_by="old", comment="", created_at=utcnow()))
        await s.commit()
    gw.client.blocking_portal.call(gw.runtime.routes.refresh)  # the pools belong to the app's loop


async def test_a_private_address_is_refused_at_connect_time_and_health_tells_nothing(strict, tiny_model_dir):
    with BadUpstream({CHAT: ok_reply}).serving() as listening:
        for name, url in (("listening", listening.base), ("closed", "http://127.0.0.1:9")):
            await _store(strict, name, UpstreamRoute.model_validate(
                _route(tiny_model_dir, [url], health_interval_s=3600)))  # one check, at its start
        await asyncio.sleep(1.0)
        replicas = [strict.runtime.routes.get(n).pool.replicas.replicas[0] for n in ("listening", "closed")]
        # a server that answers looks the same as a closed port
        assert [r.is_healthy for r in replicas] == [False, False]
        replicas[0].is_healthy = True  # as if it had been healthy: the request itself is refused too
        _, key = await strict.make_tenant()
        r = await _chat(strict, key, "listening")
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
        assert listening.num_connections == 0  # not one connection reached it


@pytest.mark.parametrize("kind", ["sglang", "openai-compatible"])
async def test_a_server_that_cannot_isolate_tenants_needs_shared_cache_stated(gw, tiny_model_dir, kind):
    route = _route(tiny_model_dir, ["http://127.0.0.1:9"], kind=kind)
    r = await gw.client.put("/admin/v1/models/m", headers=gw.admin(), json={"route": route})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "route_not_isolated"
    assert r.json()["error"]["param"] == "route.shared_cache"
    assert "cross-tenant leakage channel" in r.json()["error"]["message"]
    r = await gw.client.put("/admin/v1/models/m", headers=gw.admin(),
                            json={"route": route | {"shared_cache": True}})
    assert r.status_code == 200 and "cross-tenant leakage channel" in r.json()["warnings"][0]
    listed = (await gw.client.get("/admin/v1/models", headers=gw.admin())).json()
    assert "cross-tenant leakage channel" in listed[1]["warnings"][0]
    vllm = await gw.client.put("/admin/v1/models/v", headers=gw.admin(),
                               json={"route": _route(tiny_model_dir, ["http://127.0.0.1:9"])})
    assert vllm.json()["warnings"] == []  # salted per tenant: nothing shared


async def test_a_stored_route_that_cannot_isolate_serves_only_tenants_allowed_to_share(gw, tiny_model_dir):
    with BadUpstream({CHAT: ok_reply}).serving() as bad:
        route = UpstreamRoute.model_validate(_route(tiny_model_dir, [bad.base], kind="sglang"))
        await _store(gw, "sg", route)
        _, plain = await gw.make_tenant()
        _, sharer = await gw.make_tenant(policy=Policy(allow_shared_upstream_cache=True))
        r = await _chat(gw, plain, "sg")
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed", r.text
        r = await _chat(gw, sharer, "sg")
        assert r.status_code == 200, r.text
        assert len(bad.seen_at(CHAT)) == 1
