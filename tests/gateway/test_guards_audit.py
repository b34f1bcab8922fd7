"""Guards with mock connections, and the fail-closed audit hook."""

from types import SimpleNamespace

import pytest
from litestar.testing import AsyncTestClient

from gateway.app import create_app
from gateway.audit_hook import AuditHook, AuditUnavailableError
from gateway.errors import Forbidden
from gateway.guards import requires_admin, requires_tenant
from gateway.principal import Principal
from gateway.schemas.admin import ADMIN_READ, ADMIN_SCOPES, TENANTS_WRITE
from policies import Policy

from .conftest import make_settings

TENANT = Principal(kind="tenant", key_id="k", tenant_id="t")
ADMIN = Principal(kind="admin", key_id="a", scopes=ADMIN_SCOPES)


def conn(user, method="GET", path="/admin/v1/tenants"):
    return SimpleNamespace(scope={"user": user, "method": method, "path_template": path})


@pytest.mark.parametrize(
    "guard,allowed,denied", [(requires_tenant, TENANT, ADMIN), (requires_admin, ADMIN, TENANT)]
)
async def test_guards(guard, allowed, denied):
    await guard(conn(allowed), None)
    for user in (denied, None):
        with pytest.raises(Forbidden):
            await guard(conn(user), None)


async def test_admin_guard_needs_the_route_scope_and_refuses_unlisted_routes():
    reader = Principal(kind="admin", key_id="r", scopes=frozenset({ADMIN_READ}))
    await requires_admin(conn(reader), None)
    await requires_admin(conn(reader, "OPTIONS", "/admin/v1/tenants"), None)
    for denied in (conn(reader, "POST"), conn(ADMIN, "GET", "/admin/v1/unlisted"), conn(ADMIN, "DELETE")):
        with pytest.raises(Forbidden) as e:
            await requires_admin(denied, None)
        assert e.value.code == "scope_required"
    writer = Principal(kind="admin", key_id="w", scopes=frozenset({TENANTS_WRITE}))
    await requires_admin(conn(writer, "POST"), None)


async def test_hook_fails_closed_only_when_required():
    def broken(name, fields):
        raise RuntimeError("store down")

    hook = AuditHook(broken)
    with pytest.raises(AuditUnavailableError):
        await hook.emit("request.admitted", request_id="r")
    await hook.emit("request.finished", required=False, request_id="r")


async def test_failed_admission_audit_is_503_and_releases_reservation(tmp_path, sqlite_url, llm):
    state = {"fail": False}

    def sink(name, fields):
        if state["fail"] and name == "request.admitted":
            raise RuntimeError("audit store down")

    app = create_app(make_settings(tmp_path, sqlite_url), engine=llm, audit_sink=sink)
    async with AsyncTestClient(app, timeout=60) as client:
        from .conftest import Gateway

        gw = Gateway(client, "", app.state.runtime.settings)
        _, key = await gw.make_tenant(policy=Policy(max_concurrent_requests=1))
        body = {"model": llm.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        h = {"Authorization": f"Bearer {key}"}
        state["fail"] = True
        r = await client.post("/v1/chat/completions", headers=h, json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "audit_unavailable"
        state["fail"] = False
        assert (await client.post("/v1/chat/completions", headers=h, json=body)).status_code == 200
