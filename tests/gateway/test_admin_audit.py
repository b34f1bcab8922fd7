"""Every admin change, through the API or ``kvgate admin``, leaves exactly one audit event naming its
actor, committed with the change; the chain still verifies. The operations are read from the app's routes
and the CLI's commands, so a new one fails here until it is listed with the event it records."""

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update
from typer.testing import CliRunner

from audit.tables import audit_events, retained_prompts
from gateway.app import create_app
from gateway.cli import app as cli_app
from gateway.cli.admin_cmds import admin_app
from gateway.cli.common import cli_actor
from gateway.clock import utcnow
from gateway.schemas.admin import ADMIN_READ, ADMIN_SCOPES
from gateway.tenancy import keys

from .conftest import SETUP, make_settings, open_gateway
from .test_admin_scopes import _admin_routes
from .upstreams import LOOPBACK

_T = "/admin/v1/tenants/{tenant_id}"
# Each changing admin route (any method but GET) and the one event it records.
API_EVENTS = {
    ("POST", "/admin/v1/tenants"): "admin.tenant_created",
    ("POST", f"{_T}/disable"): "admin.tenant_disabled",
    ("POST", f"{_T}/enable"): "admin.tenant_enabled",
    ("PUT", f"{_T}/policy"): "admin.policy_changed",
    ("POST", f"{_T}/keys"): "admin.key_created",
    ("POST", f"{_T}/keys/{{key_id}}/revoke"): "admin.key_revoked",
    ("POST", f"{_T}/keys/{{key_id}}/rotate"): "admin.key_rotated",
    ("POST", f"{_T}/retention/shred"): "retention.key_shredded",
    ("POST", "/admin/v1/retention/purge"): "retention.purged",
    ("POST", "/admin/v1/admin-tokens"): "admin.admin_token_created",
    ("POST", "/admin/v1/admin-tokens/{token_id}/revoke"): "admin.admin_token_revoked",
    # a route is put before it is deleted: the dict's order is the order they run in
    ("PUT", "/admin/v1/models/{name}"): "admin.model_route_changed",
    ("DELETE", "/admin/v1/models/{name}"): "admin.model_route_deleted",
}
API_BODIES = {
    "/admin/v1/tenants": {"name": "made-by-api"},
    f"{_T}/policy": {"policy": {"tokens_per_minute": 1000}},
    "/admin/v1/admin-tokens": {"name": "n", "scopes": [ADMIN_READ]},
}
# Each changing ``kvgate admin`` command, its arguments and its event; and the commands that only read.
CLI_EVENTS = {
    "bootstrap": (["--force"], "admin.admin_token_created"),
    "create-token": (["n", "--scope", ADMIN_READ], "admin.admin_token_created"),
    "revoke-token": (["{token_id}"], "admin.admin_token_revoked"),
    "create-tenant": (["made-by-cli"], "admin.tenant_created"),
    "disable-tenant": (["{tenant_id}"], "admin.tenant_disabled"),
    "create-key": (["{tenant_id}"], "admin.key_created"),
    "revoke-key": (["{tenant_id}", "{key_id}"], "admin.key_revoked"),
    "rotate-key": (["{tenant_id}", "{key_id}"], "admin.key_rotated"),
    "set-policy": (["{tenant_id}", "{policy_file}", "--comment", "tighten"], "admin.policy_changed"),
}
CLI_READS = {
    "list-tokens": [],
    "list-tenants": [],
    "list-keys": ["{tenant_id}"],
    "get-policy": ["{tenant_id}"],
    "usage": ["{tenant_id}"],
}


@pytest.fixture
async def agw(tmp_path, db_url, llm):
    async for g in open_gateway(tmp_path, db_url, llm, **LOOPBACK):  # a route to 127.0.0.1
        yield g


def test_every_changing_operation_is_listed_with_its_event(tmp_path, sqlite_url):
    """A new admin route or ``kvgate admin`` command must be listed above, with the event it records."""
    routes = _admin_routes(create_app(make_settings(tmp_path, sqlite_url)))
    assert {(m, path) for m, path in routes if m not in ("GET", "HEAD")} == set(API_EVENTS)
    commands = {c.name for c in admin_app.registered_commands}
    assert commands == set(CLI_EVENTS) | set(CLI_READS)


async def _world(gw, policy_file) -> dict[str, str]:
    """A tenant with a key and an expired retained record, and an admin token: what an operation acts on."""
    rt = gw.runtime
    tid, _ = await gw.make_tenant()
    async with rt.sessionmaker() as s:
        key = await keys.create_key(s, rt.hasher, SETUP, tid, "k", None)
        token = await keys.create_admin_token(s, rt.hasher, "target", frozenset({ADMIN_READ}))
    await rt.retention.put(tid, "p", "c", retain_days=1)
    async with rt.db.begin() as conn:
        past = utcnow() - timedelta(days=2)
        await conn.execute(update(retained_prompts).where(retained_prompts.c.tenant_id == tid).values(
            expires_at=past))
    return {"tenant_id": tid, "key_id": key.info.id, "token_id": token.split("_")[1],
            "policy_file": str(policy_file)}


async def _last_seq(gw) -> int:
    async with gw.runtime.db.connect() as conn:
        return (await conn.execute(select(func.coalesce(func.max(audit_events.c.seq), 0)))).scalar_one()


async def _events_after(gw, seq: int) -> list[tuple[str, str | None]]:
    """``(name, actor)`` of the events after ``seq``, but the caller's authentication (``auth.success``)."""
    async with gw.runtime.db.connect() as conn:
        rows = await conn.execute(select(audit_events.c.name, audit_events.c.actor)
                                  .where(audit_events.c.seq > seq).order_by(audit_events.c.seq))
        return [(name, actor) for name, actor in rows if not name.startswith("auth.")]


def _cli(gw, *args: str):  # type: ignore[no-untyped-def]
    where = ["--data-dir", str(gw.settings.data_dir), "--db-url", gw.settings.database_url]
    return CliRunner().invoke(cli_app, [*args, *where])


async def _verify_chain(gw, tmp_path) -> None:
    bundle = tmp_path / "bundle.tar"
    res = await asyncio.to_thread(_cli, gw, "audit", "export", "--out", str(bundle))
    assert res.exit_code == 0, res.output
    public_key = gw.settings.data_dir / "audit_public_key.pem"
    res = CliRunner().invoke(cli_app, ["audit", "verify", str(bundle), "--public-key", str(public_key)])
    assert res.exit_code == 0, res.output


async def test_every_api_change_records_one_event_with_its_actor(agw, tmp_path, tiny_model_dir):
    route = {"kind": "vllm", "urls": ["http://127.0.0.1:9/v1"], "tokenizer": str(tiny_model_dir),
             "max_model_len": 2048}
    bodies = {**API_BODIES, ("PUT", "/admin/v1/models/{name}"): {"route": route}}
    rt = agw.runtime
    async with rt.sessionmaker() as s:
        root = await keys.create_admin_token(s, rt.hasher, "root", ADMIN_SCOPES)
    headers, actor = {"Authorization": f"Bearer {root}"}, root.split("_")[1]
    for (method, path), event in API_EVENTS.items():
        world = await _world(agw, tmp_path / "unused.json")
        url = path.format(**world, name="audited-route")
        before = await _last_seq(agw)
        body = bodies.get((method, path), bodies.get(path))
        r = await agw.client.request(method, url, headers=headers, json=body if method != "DELETE" else None)
        assert r.status_code in (200, 201), (method, path, r.text)
        assert await _events_after(agw, before) == [(event, actor)], (method, path)
    await _verify_chain(agw, tmp_path)


async def test_every_cli_change_records_one_event_with_its_actor(agw, tmp_path):
    policy_file = tmp_path / "policy.json"
    policy_file.write_text('{"tokens_per_minute": 1000}')
    for command, (args, event) in CLI_EVENTS.items():
        world = await _world(agw, policy_file)
        before = await _last_seq(agw)
        res = await asyncio.to_thread(_cli, agw, "admin", command, *[a.format(**world) for a in args])
        assert res.exit_code == 0, (command, res.output)
        assert await _events_after(agw, before) == [(event, cli_actor())], command
    world = await _world(agw, policy_file)
    before = await _last_seq(agw)
    for command, args in CLI_READS.items():
        res = await asyncio.to_thread(_cli, agw, "admin", command, *[a.format(**world) for a in args])
        assert res.exit_code == 0, (command, res.output)
    assert await _events_after(agw, before) == []
    await _verify_chain(agw, tmp_path)


def test_the_cli_actor_names_the_os_account():
    import os
    import pwd

    assert cli_actor() == f"cli:{pwd.getpwuid(os.geteuid()).pw_name}"


async def _make_tenant_via(gw, door: str, name: str) -> int:
    if door == "api":
        r = await gw.client.post("/admin/v1/tenants", headers=gw.admin(), json={"name": name})
        return r.status_code
    return (await asyncio.to_thread(_cli, gw, "admin", "create-tenant", name)).exit_code


@pytest.mark.parametrize("door,refused", [("api", 503), ("cli", 2)])
async def test_a_change_that_cannot_be_audited_does_not_happen(gw, door, refused):
    """The event commits in the change's transaction: when it cannot be written, the tenant is not made."""
    async with gw.runtime.db.begin() as conn:
        await conn.execute(text(
            "CREATE TRIGGER tenant_audit_fail BEFORE INSERT ON audit_events "
            "WHEN NEW.name = 'admin.tenant_created' BEGIN SELECT RAISE(ABORT, 'audit disk full'); END"))
    assert await _make_tenant_via(gw, door, "unaudited") == refused
    listed = (await gw.client.get("/admin/v1/tenants", headers=gw.admin())).json()
    assert "unaudited" not in [t["name"] for t in listed]
