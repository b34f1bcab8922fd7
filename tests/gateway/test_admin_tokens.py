"""Admin tokens over the API and the CLI: mint within one's own scopes and lifetime, list, revoke, expire;
every change audited (SQLite and PostgreSQL)."""

import asyncio

import orjson
import pytest
from sqlalchemy import select, text

from audit.tables import audit_events
from gateway.cli.common import cli_actor
from gateway.schemas.admin import ADMIN_READ, ADMIN_SCOPES, KEYS_WRITE, TOKENS_WRITE
from gateway.tenancy import keys

from .conftest import open_gateway

TOKENS = "/admin/v1/admin-tokens"


@pytest.fixture
async def agw(tmp_path, db_url, llm):
    async for g in open_gateway(tmp_path, db_url, llm):
        yield g


async def _bearer(gw, scopes) -> dict[str, str]:
    rt = gw.runtime
    async with rt.sessionmaker() as s:
        token = await keys.create_admin_token(s, rt.hasher, "issuer", frozenset(scopes))
    return {"Authorization": f"Bearer {token}"}


async def _mint(gw, headers, scopes, **extra):
    body = {"name": "n", "scopes": sorted(scopes), **extra}
    return await gw.client.post(TOKENS, headers=headers, json=body)


async def _token_events(gw) -> list[tuple[str, str, dict]]:
    async with gw.runtime.db.connect() as conn:
        rows = (await conn.execute(select(audit_events).order_by(audit_events.c.seq))).all()
    return [(r.name, r.actor, orjson.loads(r.data)) for r in rows if r.name.startswith("admin.admin_token")]


async def test_mint_list_revoke_and_audit(agw):
    root = await _bearer(agw, ADMIN_SCOPES)
    r = await _mint(agw, root, {ADMIN_READ}, expires_in_seconds=600)
    assert r.status_code == 201, r.text
    token, info = r.json()["token"], r.json()["info"]
    assert token.startswith(f"kvga_{info['id']}_") and info["scopes"] == [ADMIN_READ] and info["expires_at"]
    reader = {"Authorization": f"Bearer {token}"}
    assert (await agw.client.get("/admin/v1/tenants", headers=reader)).status_code == 200
    assert (await agw.client.post("/admin/v1/tenants", headers=reader, json={"name": "x"})).status_code == 403
    listed = (await agw.client.get(TOKENS, headers=reader)).json()
    assert info in listed and token.split("_")[2] not in str(listed)
    r = await agw.client.post(f"{TOKENS}/{info['id']}/revoke", headers=root)
    assert r.status_code == 200 and r.json()["revoked_at"]
    r = await agw.client.get("/admin/v1/tenants", headers=reader)
    assert r.status_code == 401 and r.json()["error"]["code"] == "expired_or_revoked_api_key"
    assert (await agw.client.post(f"{TOKENS}/{'0' * 16}/revoke", headers=root)).status_code == 404
    root_id = root["Authorization"].split("_")[1]
    events = await _token_events(agw)
    assert [(name, actor, data["target_id"]) for name, actor, data in events] == [
        ("admin.admin_token_created", root_id, info["id"]),
        ("admin.admin_token_revoked", root_id, info["id"]),
    ]
    assert events[0][2]["after"]["scopes"] == [ADMIN_READ] and token.split("_")[2] not in str(events)


async def test_a_token_cannot_mint_or_revoke_beyond_its_own_scopes(gw):
    minter = await _bearer(gw, {TOKENS_WRITE, ADMIN_READ})
    r = await _mint(gw, minter, {ADMIN_READ, KEYS_WRITE})
    assert r.status_code == 403 and r.json()["error"]["code"] == "scope_required"
    assert KEYS_WRITE in r.json()["error"]["message"]
    assert (await _mint(gw, minter, {ADMIN_READ})).status_code == 201
    root = await _bearer(gw, ADMIN_SCOPES)
    root_id = root["Authorization"].split("_")[1]
    r = await gw.client.post(f"{TOKENS}/{root_id}/revoke", headers=minter)
    assert r.status_code == 403 and (await gw.client.get(TOKENS, headers=root)).status_code == 200
    assert (await _mint(gw, gw.admin(), {ADMIN_READ})).status_code == 403  # no tokens:write


async def test_a_token_cannot_outlive_its_issuer(gw):
    root = await _bearer(gw, ADMIN_SCOPES)
    r = await _mint(gw, root, ADMIN_SCOPES, expires_in_seconds=60)
    short = {"Authorization": f"Bearer {r.json()['token']}"}
    for extra in ({}, {"expires_in_seconds": 3600}):
        r = await _mint(gw, short, {ADMIN_READ}, **extra)
        assert r.status_code == 403 and r.json()["error"]["code"] == "token_outlives_issuer", extra
    assert (await _mint(gw, short, {ADMIN_READ}, expires_in_seconds=30)).status_code == 201


@pytest.mark.parametrize("body,param", [
    ({"scopes": []}, "scopes"),
    ({"scopes": ["root"]}, "scopes"),
    ({"scopes": [ADMIN_READ], "expires_in_seconds": 0}, "expires_in_seconds"),
    ({"scopes": [ADMIN_READ], "expires_in_seconds": -5}, "expires_in_seconds"),
    ({"scopes": [ADMIN_READ], "secret": "x"}, "secret"),
])
async def test_bad_mint_requests_are_400(gw, body, param):
    r = await gw.client.post(TOKENS, headers=await _bearer(gw, ADMIN_SCOPES), json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_an_unauditable_mint_issues_nothing(gw):
    root = await _bearer(gw, ADMIN_SCOPES)
    async with gw.runtime.db.begin() as conn:
        await conn.execute(text(
            "CREATE TRIGGER token_audit_fail BEFORE INSERT ON audit_events "
            "WHEN NEW.name = 'admin.admin_token_created' BEGIN SELECT RAISE(ABORT, 'audit disk full'); END"))
    before = (await gw.client.get(TOKENS, headers=root)).json()
    r = await _mint(gw, root, {ADMIN_READ})
    assert r.status_code == 503 and r.json()["error"]["code"] == "audit_unavailable"
    assert (await gw.client.get(TOKENS, headers=root)).json() == before


def _cli(gw, *args: str):
    from typer.testing import CliRunner

    from gateway.cli import app

    where = ["--data-dir", str(gw.settings.data_dir), "--db-url", gw.settings.database_url]
    return CliRunner().invoke(app, ["admin", *args, *where])


async def test_cli_token_lifecycle_is_audited(gw):
    res = await asyncio.to_thread(_cli, gw, "bootstrap", "--force")
    assert res.exit_code == 0, res.output
    boot = {"Authorization": f"Bearer {res.output.strip().splitlines()[-1]}"}
    res = await asyncio.to_thread(_cli, gw, "create-token", "ro", "--scope", ADMIN_READ,
                                  "--expires-in-seconds", "600")
    assert res.exit_code == 0, res.output
    ro_id = res.output.strip().splitlines()[-1].split("_")[1]
    listed = {t["id"]: t for t in orjson.loads((await asyncio.to_thread(_cli, gw, "list-tokens")).output)}
    boot_id = boot["Authorization"].split("_")[1]
    assert listed[boot_id]["scopes"] == sorted(ADMIN_SCOPES) and listed[boot_id]["expires_at"] is None
    assert listed[ro_id]["scopes"] == [ADMIN_READ] and listed[ro_id]["expires_at"]
    res = await asyncio.to_thread(_cli, gw, "revoke-token", boot_id)
    assert res.exit_code == 0 and orjson.loads(res.output)["revoked_at"]
    assert (await gw.client.get("/admin/v1/tenants", headers=boot)).status_code == 401
    events = [(name, actor, data["target_id"]) for name, actor, data in await _token_events(gw)]
    created, revoked = "admin.admin_token_created", "admin.admin_token_revoked"
    cli = cli_actor()
    assert events == [(created, cli, boot_id), (created, cli, ro_id), (revoked, cli, boot_id)]


@pytest.mark.parametrize("args,message", [
    (("create-token", "x"), "at least one scope"),
    (("create-token", "x", "--scope", ADMIN_READ, "--expires-in-seconds", "0"), "no expiry"),
    (("bootstrap", "--force", "--expires-in-seconds", "-1"), "no expiry"),
    (("revoke-token", "0" * 16), "No such admin token"),
])
async def test_cli_refuses_bad_token_requests(gw, args, message):
    res = await asyncio.to_thread(_cli, gw, *args)
    assert res.exit_code != 0 and message in res.output, res.output
    assert await _token_events(gw) == []
