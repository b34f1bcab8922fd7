"""Admin API over SQLite and PostgreSQL: tenants, keys, versioned policies, usage reports."""

import asyncio
import csv
import io

import pytest

from gateway.errors import InvalidRequest
from gateway.tenancy import keys

from .conftest import SETUP, open_gateway


@pytest.fixture
async def agw(tmp_path, db_url, llm):
    async for g in open_gateway(tmp_path, db_url, llm):
        yield g


async def test_tenant_crud(agw):
    c, h = agw.client, agw.admin()
    r = await c.post("/admin/v1/tenants", headers=h, json={"name": "acme"})
    assert r.status_code == 201
    tid = r.json()["id"]
    assert (await c.post("/admin/v1/tenants", headers=h, json={"name": "acme"})).status_code == 409
    assert (await c.get(f"/admin/v1/tenants/{tid}", headers=h)).json()["name"] == "acme"
    assert [t["id"] for t in (await c.get("/admin/v1/tenants", headers=h)).json()] == [tid]
    assert (await c.get("/admin/v1/tenants/nope", headers=h)).status_code == 404
    assert (await c.post("/admin/v1/tenants", headers=h, json={"name": "bad name!"})).status_code == 400
    assert (await c.post("/admin/v1/tenants", headers=h, json={"name": "x", "extra": 1})).status_code == 400


async def test_keys_lifecycle(agw):
    c, h = agw.client, agw.admin()
    tid = (await c.post("/admin/v1/tenants", headers=h, json={"name": "k"})).json()["id"]
    r = await c.post(
        f"/admin/v1/tenants/{tid}/keys", headers=h, json={"name": "ci", "expires_in_seconds": 60}
    )
    assert r.status_code == 201
    key, info = r.json()["key"], r.json()["info"]
    assert key.startswith(f"kvg_{info['id']}_") and info["expires_at"]
    listed = (await c.get(f"/admin/v1/tenants/{tid}/keys", headers=h)).json()
    assert [k["id"] for k in listed] == [info["id"]] and key not in str(listed)
    other = (await c.post("/admin/v1/tenants", headers=h, json={"name": "k2"})).json()["id"]
    # a key id is only reachable under its own tenant
    assert (await c.post(f"/admin/v1/tenants/{other}/keys/{info['id']}/revoke", headers=h)).status_code == 404


async def test_policy_versioning(agw):
    c, h = agw.client, agw.admin()
    tid = (await c.post("/admin/v1/tenants", headers=h, json={"name": "p"})).json()["id"]
    p1 = (await c.get(f"/admin/v1/tenants/{tid}/policy", headers=h)).json()
    assert p1["version"] == 1 and p1["policy"]["prefix_cache_scope"] == "tenant"
    new = {"tokens_per_minute": 1000, "prefix_cache_scope": "key", "allowed_determinism": ["fast", "fixed"]}
    r = await c.put(
        f"/admin/v1/tenants/{tid}/policy",
        headers=h,
        json={"policy": new, "comment": "tighten", "expected_version": 1},
    )
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2 and r.json()["changed_by"] == agw.admin_token.split("_")[1]
    r = await c.put(f"/admin/v1/tenants/{tid}/policy", headers=h, json={"policy": new, "expected_version": 1})
    assert r.status_code == 409
    r = await c.put(
        f"/admin/v1/tenants/{tid}/policy",
        headers=h,
        json={"policy": {"default_determinism": "fixed", "allowed_determinism": ["fast"]}},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    history = (await c.get(f"/admin/v1/tenants/{tid}/policy/history", headers=h)).json()
    assert [(p["version"], p["comment"]) for p in history] == [(1, "initial"), (2, "tighten")]


async def test_usage_report_json_and_csv(agw):
    tid, key = await agw.make_tenant()
    model = agw.runtime.engine.model_name
    for _ in range(2):
        r = await agw.client.post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "prompt": "hello", "max_tokens": 3},
        )
        assert r.status_code == 200
    rows = (await agw.client.get(f"/admin/v1/tenants/{tid}/usage?window=day", headers=agw.admin())).json()
    assert len(rows) == 1 and rows[0]["num_requests"] == 2
    assert rows[0]["completion_tokens"] == 6 and rows[0]["total_tokens"] == rows[0]["prompt_tokens"] + 6
    r = await agw.client.get(f"/admin/v1/tenants/{tid}/usage?window=month&format=csv", headers=agw.admin())
    assert r.headers["content-type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(r.text)))
    assert parsed[0]["num_requests"] == "2" and parsed[0]["completion_tokens"] == "6"
    assert (
        await agw.client.get(f"/admin/v1/tenants/{tid}/usage?window=year", headers=agw.admin())
    ).status_code == 400


@pytest.mark.parametrize("seconds", [0, -1])
async def test_a_key_expiry_of_zero_or_less_is_refused_not_never(agw, seconds):
    """``expires_in_seconds`` 0 used to issue a key that never expires; only omitting it means that."""
    tid, _ = await agw.make_tenant()
    rt, url = agw.runtime, f"/admin/v1/tenants/{tid}/keys"
    r = await agw.client.post(url, headers=agw.admin(), json={"expires_in_seconds": seconds})
    assert r.status_code == 400 and r.json()["error"]["param"] == "expires_in_seconds"
    async with rt.sessionmaker() as s:
        with pytest.raises(InvalidRequest, match="omit it for no expiry"):
            await keys.create_key(s, rt.hasher, SETUP, tid, "k", seconds)
    from typer.testing import CliRunner

    from gateway.cli import app

    where = ["--data-dir", str(agw.settings.data_dir), "--db-url", agw.settings.database_url]
    res = await asyncio.to_thread(
        CliRunner().invoke, app, ["admin", "create-key", tid, f"--expires-in-seconds={seconds}", *where]
    )
    assert res.exit_code != 0 and "omit the option for no expiry" in res.output, res.output
    listed = (await agw.client.get(url, headers=agw.admin())).json()
    assert len(listed) == 1  # the one make_tenant issued; none of the refused ones
    res = await asyncio.to_thread(CliRunner().invoke, app, ["admin", "create-key", tid, *where])
    assert res.exit_code == 0 and '"expires_at": null' in res.output, res.output
