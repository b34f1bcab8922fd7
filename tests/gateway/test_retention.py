"""Optional prompt retention: off by default, encrypted when on, read only under scope, crypto-shredded."""

import asyncio
import secrets
from datetime import UTC, datetime, timedelta

import orjson
import pytest
from sqlalchemy import insert, select, update

from audit.tables import audit_events, retained_prompts
from gateway.tenancy import keys
from policies import Policy

from .conftest import open_gateway


def _marker() -> str:
    return f"RETAIN-{secrets.token_hex(8)}"


async def _chat(gw, key: str, content: str, **extra) -> dict:
    body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": 3, **extra}
    r = await gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
    assert r.status_code == 200, r.text
    return r.json() if not extra.get("stream") else {}


async def _scoped_admin(gw) -> dict[str, str]:
    rt = gw.runtime
    async with rt.sessionmaker() as s:
        token = await keys.create_admin_token(s, rt.hasher, "dpo", frozenset({keys.RETENTION_READ}))
    return {"Authorization": f"Bearer {token}"}


async def _rows(gw, table) -> list:
    async with gw.runtime.db.connect() as conn:
        return (await conn.execute(select(table))).all()


@pytest.mark.parametrize("value", [-1, 3651, True, "7"])
async def test_policy_switch_is_validated(gw, value):
    tid, _ = await gw.make_tenant()
    r = await gw.client.put(f"/admin/v1/tenants/{tid}/policy", headers=gw.admin(),
                            json={"policy": {"prompt_retention_days": value}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "policy.prompt_retention_days"
    stored = (await gw.client.get(f"/admin/v1/tenants/{tid}/policy", headers=gw.admin())).json()
    assert stored["version"] == 1 and stored["policy"]["prompt_retention_days"] == 0  # nothing changed


async def test_off_by_default_stores_nothing(gw):
    tid, key = await gw.make_tenant()
    await _chat(gw, key, _marker())
    assert await _rows(gw, retained_prompts) == []
    r = await gw.client.get(f"/admin/v1/tenants/{tid}/retention", headers=gw.admin())
    assert r.status_code == 200 and r.json() == []


async def test_on_stores_encrypted_and_reads_only_under_scope(gw):
    tid, key = await gw.make_tenant(policy=Policy(prompt_retention_days=7))
    marker = _marker()
    out = await _chat(gw, key, f"remember {marker}")
    await _chat(gw, key, f"streamed {marker}", stream=True)
    (row, _) = sorted(await _rows(gw, retained_prompts), key=lambda r: r.created_at)
    assert marker.encode() not in row.ciphertext and row.tenant_id == tid
    listed = (await gw.client.get(f"/admin/v1/tenants/{tid}/retention", headers=gw.admin())).json()
    assert {rec["id"] for rec in listed} == {r.id for r in await _rows(gw, retained_prompts)}
    url = f"/admin/v1/tenants/{tid}/retention/{row.id}"
    r = await gw.client.get(url, headers=gw.admin(), params={"reason": "ticket 42"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "scope_required"
    _, other_key = await gw.make_tenant()
    assert (await gw.client.get(url, headers={"Authorization": f"Bearer {other_key}"})).status_code == 403
    scoped = await _scoped_admin(gw)
    assert (await gw.client.get(url, headers=scoped)).json()["error"]["param"] == "reason"
    r = await gw.client.get(url, headers=scoped, params={"reason": "ticket 42"})
    assert r.status_code == 200, r.text
    record = r.json()
    assert record["prompt"] == [{"role": "user", "content": f"remember {marker}"}]
    assert record["completion"] == [out["choices"][0]["message"]["content"]]
    reads = [r for r in await _rows(gw, audit_events) if r.name == "retention.record_read"]
    assert [orjson.loads(r.data) for r in reads] == [{"reason": "ticket 42", "record_id": row.id}]
    assert reads[0].actor == scoped["Authorization"].split("_")[1] and reads[0].tenant_id == tid


async def test_shredding_the_data_key_makes_records_unreadable_at_once(gw):
    tid, key = await gw.make_tenant(policy=Policy(prompt_retention_days=7))
    await _chat(gw, key, _marker())
    (backup,) = await _rows(gw, retained_prompts)
    scoped, reason = await _scoped_admin(gw), {"reason": "export request"}
    url = f"/admin/v1/tenants/{tid}/retention/{backup.id}"
    assert (await gw.client.get(url, headers=scoped, params=reason)).status_code == 200
    r = await gw.client.post(f"/admin/v1/tenants/{tid}/retention/shred", headers=gw.admin())
    assert r.status_code == 200 and r.json() == {"tenant_id": tid, "num_records": 1}
    assert (await gw.client.get(url, headers=scoped, params=reason)).status_code == 404
    # A backup of the ciphertext, restored after the shred, stays unreadable: its key is gone.
    async with gw.runtime.db.begin() as conn:
        await conn.execute(insert(retained_prompts).values(**backup._mapping))
    r = await gw.client.get(url, headers=scoped, params=reason)
    assert r.status_code == 404 and "shredded" in r.json()["error"]["message"]
    events = [(e.name, orjson.loads(e.data)) for e in await _rows(gw, audit_events) if e.tenant_id == tid]
    assert ("retention.key_shredded", {"num_records": 1}) in events
    r = await gw.client.post("/admin/v1/tenants/nope/retention/shred", headers=gw.admin())
    assert r.status_code == 404


async def test_expired_records_are_unreadable_then_purged(gw):
    tid, key = await gw.make_tenant(policy=Policy(prompt_retention_days=1))
    await _chat(gw, key, _marker())
    (row,) = await _rows(gw, retained_prompts)
    async with gw.runtime.db.begin() as conn:
        past = datetime.now(UTC) - timedelta(seconds=1)
        await conn.execute(update(retained_prompts).values(expires_at=past))
    scoped = await _scoped_admin(gw)
    r = await gw.client.get(f"/admin/v1/tenants/{tid}/retention/{row.id}", headers=scoped,
                            params={"reason": "audit"})
    assert r.status_code == 404
    r = await gw.client.post("/admin/v1/retention/purge", headers=gw.admin())
    assert r.status_code == 200 and r.json() == {"num_deleted": 1}
    assert await _rows(gw, retained_prompts) == []
    assert "retention.purged" in {e.name for e in await _rows(gw, audit_events)}


async def test_startup_purges_expired_records(tmp_path, sqlite_url, llm):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(prompt_retention_days=1))
        await _chat(gw, key, _marker())
        async with gw.runtime.db.begin() as conn:
            await conn.execute(update(retained_prompts).values(expires_at=datetime.now(UTC)))
    async for gw in open_gateway(tmp_path, sqlite_url, llm):  # a restart
        assert await _rows(gw, retained_prompts) == []
        purged = [e for e in await _rows(gw, audit_events) if e.name == "retention.purged"]
        assert [(e.actor, orjson.loads(e.data)) for e in purged] == [("system", {"num_deleted": 1})]


async def test_cli_issues_scoped_admin_tokens(gw):
    from typer.testing import CliRunner

    from gateway.cli import app

    args = ["admin", "create-token", "dpo", "--scope", "retention:read",
            "--data-dir", str(gw.settings.data_dir), "--db-url", gw.settings.database_url]
    res = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert res.exit_code == 0, res.output
    token = res.output.strip().splitlines()[-1]
    tid, key = await gw.make_tenant(policy=Policy(prompt_retention_days=7))
    await _chat(gw, key, _marker())
    (row,) = await _rows(gw, retained_prompts)
    r = await gw.client.get(f"/admin/v1/tenants/{tid}/retention/{row.id}",
                            headers={"Authorization": f"Bearer {token}"}, params={"reason": "cli token"})
    assert r.status_code == 200, r.text
    res = await asyncio.to_thread(CliRunner().invoke, app, [*args[:3], "--scope", "root", *args[5:]])
    assert res.exit_code == 2 and "unknown scope" in res.output


async def test_tenant_keys_cannot_reach_retention(gw):
    tid, key = await gw.make_tenant()
    h = {"Authorization": f"Bearer {key}"}
    for method, path in [("get", f"/admin/v1/tenants/{tid}/retention"),
                         ("post", f"/admin/v1/tenants/{tid}/retention/shred"),
                         ("post", "/admin/v1/retention/purge")]:
        assert (await getattr(gw.client, method)(path, headers=h)).status_code == 403, path
    r = await gw.client.get(f"/admin/v1/tenants/{tid}/retention", headers=gw.admin(), params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


async def test_unknown_admin_scope_is_refused(gw):
    rt = gw.runtime
    async with rt.sessionmaker() as s:
        with pytest.raises(ValueError, match="unknown admin scopes"):
            await keys.create_admin_token(s, rt.hasher, "x", frozenset({"everything"}))
