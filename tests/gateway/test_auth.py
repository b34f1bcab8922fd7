"""Authentication and authorization: 401s for bad keys, 403s across the tenant/admin boundary."""

from datetime import timedelta

import pytest
from sqlalchemy import update

from gateway.clock import utcnow
from gateway.storage.models import ApiKey

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def chat(gw, headers):
    return await gw.client.post(
        "/v1/chat/completions", headers=headers, json=CHAT | {"model": gw.runtime.engine.model_name}
    )


def assert_openai_error(r, status, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code


@pytest.mark.parametrize(
    "headers,code",
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Basic abc"}, "malformed_api_key"),
        ({"Authorization": "Bearer "}, "malformed_api_key"),
        ({"Authorization": "Bearer kvg_nothex_abc"}, "malformed_api_key"),
        ({"Authorization": "Bearer kvg_0123456789abcdef_" + "x" * 43}, "invalid_api_key"),
        ({"Authorization": "Bearer kvg_0123456789abcdef_' OR 1=1 --"}, "malformed_api_key"),
    ],
)
async def test_bad_keys_are_401(gw, headers, code):
    assert_openai_error(await chat(gw, headers), 401, code)
    assert_openai_error(await gw.client.get("/v1/models", headers=headers), 401)


async def test_wrong_secret_for_real_key_id_is_401(gw):
    _, key = await gw.make_tenant()
    prefix, key_id, secret = key.split("_", 2)
    forged = f"{prefix}_{key_id}_{'A' * len(secret)}"
    assert_openai_error(await chat(gw, bearer(forged)), 401, "invalid_api_key")
    assert (await chat(gw, bearer(key))).status_code == 200


async def test_revoked_key_is_401_on_next_request(gw):
    tid, key = await gw.make_tenant()
    key_id = key.split("_")[1]
    assert (await chat(gw, bearer(key))).status_code == 200
    r = await gw.client.post(f"/admin/v1/tenants/{tid}/keys/{key_id}/revoke", headers=gw.admin())
    assert r.status_code == 200 and r.json()["revoked_at"]
    assert_openai_error(await chat(gw, bearer(key)), 401)


async def test_expired_key_is_401(gw):
    _, key = await gw.make_tenant()
    async with gw.runtime.sessionmaker() as s:
        await s.execute(
            update(ApiKey)
            .where(ApiKey.id == key.split("_")[1])
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
        await s.commit()
    assert_openai_error(await chat(gw, bearer(key)), 401)


async def test_disabled_tenant_is_401(gw):
    tid, key = await gw.make_tenant()
    assert (await gw.client.post(f"/admin/v1/tenants/{tid}/disable", headers=gw.admin())).status_code == 200
    assert_openai_error(await chat(gw, bearer(key)), 401)
    assert (await gw.client.post(f"/admin/v1/tenants/{tid}/enable", headers=gw.admin())).status_code == 200
    assert (await chat(gw, bearer(key))).status_code == 200


async def test_rotation_keeps_old_key_during_overlap_only(gw):
    tid, key = await gw.make_tenant()
    key_id = key.split("_")[1]
    r = await gw.client.post(
        f"/admin/v1/tenants/{tid}/keys/{key_id}/rotate", headers=gw.admin(), json={"overlap_seconds": 3600}
    )
    assert r.status_code == 201
    new_key = r.json()["key"]
    assert (await chat(gw, bearer(key))).status_code == 200
    assert (await chat(gw, bearer(new_key))).status_code == 200
    r = await gw.client.post(
        f"/admin/v1/tenants/{tid}/keys/{new_key.split('_')[1]}/rotate",
        headers=gw.admin(),
        json={"overlap_seconds": 0},
    )
    assert_openai_error(await chat(gw, bearer(new_key)), 401)
    assert (await chat(gw, bearer(r.json()["key"]))).status_code == 200


async def test_tenant_key_cannot_reach_admin_or_metrics(gw):
    tid, key = await gw.make_tenant()
    other, _ = await gw.make_tenant()
    for method, path in [
        ("GET", "/admin/v1/tenants"),
        ("GET", f"/admin/v1/tenants/{tid}"),
        ("GET", f"/admin/v1/tenants/{other}/policy"),
        ("GET", f"/admin/v1/tenants/{other}/keys"),
        ("POST", f"/admin/v1/tenants/{other}/keys"),
        ("PUT", f"/admin/v1/tenants/{other}/policy"),
        ("GET", f"/admin/v1/tenants/{other}/usage"),
        ("GET", "/metrics"),
    ]:
        r = await gw.client.request(method, path, headers=bearer(key), json={})
        assert_openai_error(r, 403, "admin_token_required")


async def test_admin_token_cannot_call_v1(gw):
    assert_openai_error(await chat(gw, gw.admin()), 403, "tenant_key_required")
    assert_openai_error(await gw.client.get("/v1/models", headers=gw.admin()), 403)


async def test_public_endpoints(gw):
    assert (await gw.client.get("/healthz")).json() == {"status": "ok"}
    r = await gw.client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"model": True, "database": True}
    r = await gw.client.get("/metrics", headers=gw.admin())
    assert r.status_code == 200 and "kvgate_kv_cache_usage_ratio" in r.text


async def test_audit_hook_sees_auth_and_admin_events(tmp_path, sqlite_url, llm):
    from litestar.testing import AsyncTestClient

    from gateway.app import create_app
    from gateway.tenancy import keys

    from .conftest import make_settings

    events = []
    app = create_app(
        make_settings(tmp_path, sqlite_url), engine=llm, audit_sink=lambda n, f: events.append((n, f))
    )
    async with AsyncTestClient(app) as client:
        rt = app.state.runtime
        async with rt.sessionmaker() as s:
            token = await keys.create_admin_token(s, rt.hasher, "t")
        await client.post("/admin/v1/tenants", headers=bearer(token), json={"name": "audited"})
        await client.get("/v1/models", headers=bearer("kvg_0123456789abcdef_" + "y" * 43))
    names = [n for n, _ in events]
    assert "auth.success" in names and "admin.tenant_created" in names and "auth.failure" in names
    assert all(token not in repr(f) for _, f in events)
