"""Model routes through ``/admin/v1/models`` over SQLite and PostgreSQL: versions, audit, sealed upstream
keys, bad input as 4xx, ``/v1/models`` per tenant, and ``cache_salt`` only from a trusting policy."""

import pytest
import pytest_asyncio

from policies import Policy

from .conftest import open_gateway, tenant_events
from .realserver import migrated_db
from .upstreams import LOOPBACK

# The tests on ``shared_agw`` change nothing another test reads (refused input, tenants of their own), so
# they share one gateway per database on the module's loop instead of a new database and app each.
ON_SHARED = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture
async def agw(tmp_path, db_url, llm):
    async for g in open_gateway(tmp_path, db_url, llm, **LOOPBACK):
        g.db_url = db_url
        yield g


@pytest_asyncio.fixture(scope="module", loop_scope="module",
                        params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def shared_agw(request, tmp_path_factory, llm):
    pg_user = request.getfixturevalue("pg_user") if request.param == "postgresql" else None
    if request.param == "postgresql" and pg_user is None:
        pytest.skip("no PostgreSQL server answers (set CI=1 to make this a failure)")
    data_dir = tmp_path_factory.mktemp("upstream-admin")
    with migrated_db(request.param, data_dir, pg_user) as url:
        async for g in open_gateway(data_dir, url, llm, **LOOPBACK):
            yield g


def _route(tokenizer, **extra):
    return {"kind": "vllm", "urls": ["http://127.0.0.1:9/v1"], "tokenizer": str(tokenizer),
            "max_model_len": 2048, **extra}


async def test_route_versions_audit_and_sealed_key(agw, tiny_model_dir):
    c, h = agw.client, agw.admin()
    secret = "sk-upstream-very-secret-1234"
    r = await c.put("/admin/v1/models/org/big-model", headers=h,
                    json={"route": _route(tiny_model_dir), "api_key": secret, "comment": "first"})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["version"] == 1 and first["has_api_key"] and first["route"]["urls"] == ["http://127.0.0.1:9"]
    assert secret not in r.text
    # a new version keeps the key unless told otherwise; a stale expected_version is a 409
    r = await c.put("/admin/v1/models/org/big-model", headers=h,
                    json={"route": _route(tiny_model_dir, affinity_blocks=2), "expected_version": 1})
    assert r.status_code == 200 and r.json()["version"] == 2 and r.json()["has_api_key"]
    r = await c.put("/admin/v1/models/org/big-model", headers=h,
                    json={"route": _route(tiny_model_dir), "expected_version": 1})
    assert r.status_code == 409
    history = (await c.get("/admin/v1/model-history/org/big-model", headers=h)).json()
    assert [v["version"] for v in history] == [1, 2] and secret not in str(history)
    listed = (await c.get("/admin/v1/models", headers=h)).json()
    assert [m["backend"] for m in listed] == ["engine", "upstream"] and listed[1]["name"] == "org/big-model"
    assert (await c.get("/admin/v1/models/org/big-model", headers=h)).json()["version"] == 2
    r = await c.delete("/admin/v1/models/org/big-model", headers=h)
    assert r.status_code == 200 and r.json()["route"] is None and not r.json()["has_api_key"]
    assert (await c.get("/admin/v1/models/org/big-model", headers=h)).status_code == 404
    assert (await c.delete("/admin/v1/models/org/big-model", headers=h)).status_code == 404
    events = [(n, d) for n, _, d in await tenant_events(agw.db_url, agw.settings.data_dir, None)]
    names = [n for n, _ in events if n.startswith("admin.model_route")]
    assert names == ["admin.model_route_changed"] * 2 + ["admin.model_route_deleted"]
    assert secret not in str(events)


@pytest.mark.parametrize("body,param", [
    ({"route": {"kind": "vllm", "urls": ["ftp://x"], "tokenizer": "t", "max_model_len": 64}}, "urls"),
    ({"route": {"kind": "nope", "urls": ["http://x"], "tokenizer": "t", "max_model_len": 64}}, "kind"),
    ({"route": {"kind": "vllm", "urls": [], "tokenizer": "t", "max_model_len": 64}}, "urls"),
    ({"route": {"kind": "vllm", "urls": ["http://u:p@x"], "tokenizer": "t", "max_model_len": 64}}, "urls"),
    ({"route": {"kind": "vllm", "urls": ["http://x", "http://x/v1"], "tokenizer": "t",
                "max_model_len": 64}}, "urls"),
    ({"route": {"kind": "vllm", "urls": ["http://x"], "tokenizer": "/nowhere", "max_model_len": 64}},
     "tokenizer"),
    ({"route": {"kind": "vllm", "urls": ["http://x"], "tokenizer": "t", "max_model_len": 64}, "x": 1}, "x"),
])
@ON_SHARED
async def test_bad_routes_are_400(shared_agw, body, param):
    agw = shared_agw
    r = await agw.client.put("/admin/v1/models/m", headers=agw.admin(), json=body)
    assert r.status_code == 400, r.text
    assert param in r.text


@ON_SHARED
async def test_the_engine_model_cannot_be_routed_and_names_are_checked(shared_agw, tiny_model_dir):
    agw = shared_agw
    c, h = agw.client, agw.admin()
    engine_model = agw.runtime.engine.model_name
    r = await c.put(f"/admin/v1/models/{engine_model}", headers=h, json={"route": _route(tiny_model_dir)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_reserved"
    r = await c.put("/admin/v1/models/bad%20name", headers=h, json={"route": _route(tiny_model_dir)})
    assert r.status_code == 400


async def test_v1_models_lists_what_the_policy_allows(agw, tiny_model_dir):
    c, h = agw.client, agw.admin()
    r = await c.put("/admin/v1/models/up-a", headers=h, json={"route": _route(tiny_model_dir)})
    assert r.is_success
    engine_model = agw.runtime.engine.model_name
    _, every = await agw.make_tenant(policy=Policy())
    _, only = await agw.make_tenant(policy=Policy(allowed_models=("up-a",)))
    r = await c.get("/v1/models", headers={"Authorization": f"Bearer {every}"})
    ids = [m["id"] for m in r.json()["data"]]
    assert ids == [engine_model, "up-a"]
    auth = {"Authorization": f"Bearer {only}"}
    assert [m["id"] for m in (await c.get("/v1/models", headers=auth)).json()["data"]] == ["up-a"]
    assert (await c.get(f"/v1/models/{engine_model}", headers=auth)).status_code == 404
    assert (await c.get("/v1/models/up-a", headers=auth)).json()["determinism_modes"] == ["fast"]
    body = {"model": "up-a", "prompt": "hello", "max_tokens": 2, "determinism": "fixed"}
    r = await c.post("/v1/completions", headers=auth, json=body)  # refused before any replica is asked
    assert r.status_code == 400 and r.json()["error"]["code"] == "determinism_unavailable", r.text


async def test_an_upstream_model_and_the_engine_are_both_served_models(agw, tiny_model_dir):
    """Admission and ``/v1/models`` read either through one type: name, tokenizer, context, modes."""
    from engine import EngineClient, ServedModel

    route = {"route": _route(tiny_model_dir)}
    assert (await agw.client.put("/admin/v1/models/up-b", headers=agw.admin(), json=route)).is_success
    target, engine = agw.runtime.routes.get("up-b"), agw.runtime.engine
    assert isinstance(target, ServedModel) and not isinstance(target, EngineClient)
    assert (target.model_name, target.modes, target.bi_error) == ("up-b", ("fast",), None)
    assert target.max_model_len == target.route.max_model_len and target.tokenizer is not None
    assert isinstance(engine, EngineClient) and isinstance(engine, ServedModel)
    assert (engine.modes, engine.bi_error) == (engine.determinism.modes, engine.determinism.bi_error)


@ON_SHARED
async def test_cache_salt_only_from_a_trusting_policy(shared_agw):
    agw = shared_agw
    engine_model = agw.runtime.engine.model_name
    _, plain = await agw.make_tenant(policy=Policy())
    _, front = await agw.make_tenant(policy=Policy(trust_cache_salt=True))
    body = {"model": engine_model, "prompt": "hello there", "max_tokens": 2, "cache_salt": "abc"}
    r = await agw.client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {plain}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "cache_salt_not_allowed"
    assert r.json()["error"]["param"] == "cache_salt"
    r = await agw.client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {front}"})
    assert r.status_code == 200, r.text


async def test_a_pool_with_no_replica_up_is_a_503_charged_nothing_and_shows_in_metrics(agw, tiny_model_dir):
    c, h = agw.client, agw.admin()
    # nothing listens on these loopback ports: every connection is refused
    route = _route(tiny_model_dir, urls=["http://127.0.0.1:9", "http://127.0.0.1:7"], health_interval_s=3600)
    assert (await c.put("/admin/v1/models/down", headers=h, json={"route": route})).status_code == 200
    tid, key = await agw.make_tenant()
    body = {"model": "down", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    for stream in (False, True):
        r = await c.post("/v1/chat/completions", json=body | {"stream": stream},
                         headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
        assert r.headers["retry-after"]
    rows = (await c.get(f"/admin/v1/tenants/{tid}/usage", headers=h)).json()
    assert sum(r["num_requests"] for r in rows) == 2 and sum(r["total_tokens"] for r in rows) == 0
    metrics = (await c.get("/metrics", headers=h)).text
    assert 'kvgate_upstream_healthy{model="down",replica="http://127.0.0.1:9"} 0.0' in metrics
    assert 'kvgate_upstream_outstanding_requests{model="down",replica="http://127.0.0.1:7"} 0.0' in metrics


async def test_the_gateways_own_fields_never_reach_an_upstream_as_the_client_sent_them(agw, tiny_model_dir):
    """A priority would order every tenant's requests at the pool and a request id could collide with
    another tenant's there: like the model and the length, the gateway's, not the client's. What only
    describes the request goes as sent."""
    from gateway.schemas.openai import ChatCompletionRequest
    from gateway.upstream.call import prepare

    route = {"route": _route(tiny_model_dir)}
    assert (await agw.client.put("/admin/v1/models/up-c", headers=agw.admin(), json=route)).is_success
    schema = {"type": "object"}
    req = ChatCompletionRequest.model_validate({
        "model": "up-c", "messages": [{"role": "user", "content": "hi"}], "priority": -100,
        "request_id": "r-1", "metadata": {"team": "a"}, "determinism": "fast", "max_tokens": 99,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    body = prepare(agw.runtime.routes.get("up-c"), req, "chat", 8, b"ns", [1, 2], b"k" * 32, False).body
    assert "priority" not in body and "request_id" not in body and "determinism" not in body
    assert body["metadata"] == {"team": "a"} and body["max_tokens"] == 8 and body["model"] != ""
    # Fields under another name in the models go by the name the client sent, which the pool reads.
    assert body["response_format"]["json_schema"]["schema"] == schema
    req = ChatCompletionRequest.model_validate({"model": "up-c", "structured_outputs": {"json": schema},
                                                "messages": [{"role": "user", "content": "hi"}]})
    body = prepare(agw.runtime.routes.get("up-c"), req, "chat", 8, b"ns", [1, 2], b"k" * 32, False).body
    assert body["structured_outputs"] == {"json": schema}
