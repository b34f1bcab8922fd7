"""Every admin route needs a scope: the table covers the app's routes, a token without the scope gets 403,
and an expired or revoked admin token gets 401 on every admin route."""

from datetime import timedelta

import pytest
from litestar.routes import HTTPRoute
from sqlalchemy import update

from gateway.app import create_app
from gateway.clock import utcnow
from gateway.guards import ADMIN_ROUTE_SCOPES, requires_admin
from gateway.schemas.admin import ADMIN_SCOPES, KEYS_WRITE, RETENTION_READ
from gateway.storage.models import AdminToken
from gateway.tenancy import keys

from .conftest import make_settings, open_gateway


def _admin_routes(app) -> list[tuple[str, str]]:
    """(method, route template) of every handler the admin guard runs on, OPTIONS aside."""
    found = []
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            is_admin = requires_admin in handler.resolve_guards()
            is_api = route.path_format.startswith(("/admin/v1", "/metrics"))  # /admin/...: the console
            if is_api and "OPTIONS" not in handler.http_methods:
                assert is_admin, f"{route.path_format} is not behind the admin guard"
            if is_admin:
                found += [(m, route.path_format) for m in handler.http_methods if m != "OPTIONS"]
    return found


def test_every_admin_route_has_a_scope_and_the_table_no_stale_entry(tmp_path, sqlite_url):
    routes = _admin_routes(create_app(make_settings(tmp_path, sqlite_url)))
    assert len(routes) == len(set(routes)) >= 20
    assert set(routes) == set(ADMIN_ROUTE_SCOPES)
    assert set(ADMIN_ROUTE_SCOPES.values()) <= ADMIN_SCOPES


async def _token(gw, scopes) -> tuple[str, dict[str, str]]:
    rt = gw.runtime
    async with rt.sessionmaker() as s:
        token = await keys.create_admin_token(s, rt.hasher, "t", frozenset(scopes))
    return token.split("_")[1], {"Authorization": f"Bearer {token}"}


def _url(path: str, tenant_id: str) -> str:
    return (path.replace("{tenant_id}", tenant_id).replace("{key_id}", "0" * 16)
            .replace("{record_id}", "r0").replace("{token_id}", "0" * 16))


async def _call(gw, method: str, path: str, tenant_id: str, headers: dict[str, str]):
    kwargs = {"json": {}} if method in ("POST", "PUT") else {}
    return await gw.client.request(method, _url(path, tenant_id), headers=headers, **kwargs)


async def test_a_token_without_the_route_scope_gets_403_on_every_admin_route(gw):
    tid, _ = await gw.make_tenant()
    for (method, path), scope in ADMIN_ROUTE_SCOPES.items():
        _, lacking = await _token(gw, ADMIN_SCOPES - {scope})
        r = await _call(gw, method, path, tid, lacking)
        assert r.status_code == 403 and r.json()["error"]["code"] == "scope_required", (method, path)
        assert scope in r.json()["error"]["message"]
        _, holding = await _token(gw, {scope})
        assert (await _call(gw, method, path, tid, holding)).status_code not in (401, 403), (method, path)


async def test_a_token_without_keys_write_cannot_shred_or_manage_keys(gw):
    """A prompt reader's token (``retention:read``) used to shred a tenant's data key and revoke its keys."""
    tid, _ = await gw.make_tenant()
    _, reader = await _token(gw, {RETENTION_READ})
    for path in (f"/admin/v1/tenants/{tid}/retention/shred", f"/admin/v1/tenants/{tid}/keys"):
        r = await gw.client.post(path, headers=reader, json={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "scope_required", path
    _, manager = await _token(gw, {KEYS_WRITE})
    r = await gw.client.post(f"/admin/v1/tenants/{tid}/retention/shred", headers=manager)
    assert r.status_code == 200 and r.json()["tenant_id"] == tid


@pytest.fixture
async def roomy_gw(tmp_path, sqlite_url, llm):
    """One 401 per admin route is more failures than the per-peer limit allows (past it: 429)."""
    async for g in open_gateway(tmp_path, sqlite_url, llm, auth_failure_limit=10 * len(ADMIN_ROUTE_SCOPES)):
        yield g


@pytest.mark.parametrize("lapse", ["expired", "revoked"])
async def test_an_expired_or_revoked_admin_token_gets_401_on_every_admin_route(roomy_gw, lapse):
    gw = roomy_gw
    tid, _ = await gw.make_tenant()
    token_id, headers = await _token(gw, ADMIN_SCOPES)
    assert (await gw.client.get("/admin/v1/tenants", headers=headers)).status_code == 200
    past = utcnow() - timedelta(seconds=1)
    column = {"expires_at": past} if lapse == "expired" else {"revoked_at": past}
    async with gw.runtime.db.begin() as conn:
        await conn.execute(update(AdminToken).where(AdminToken.id == token_id).values(**column))
    for method, path in ADMIN_ROUTE_SCOPES:
        r = await _call(gw, method, path, tid, headers)
        assert r.status_code == 401, (method, path)
        assert r.json()["error"]["code"] == "expired_or_revoked_api_key"
