"""Every authentication result is audited; on completions ``auth.success`` rides in the admission's
transaction, and whatever way the request ends otherwise, it is still recorded, in order."""

import pytest

from policies import Policy

from .conftest import open_gateway, tenant_events
from .test_hot_path import _chat, _fail_store_on


async def _events(gw, db_url, tenant_id):
    """(name, path or code) of the tenant's events in chain order."""
    rows = await tenant_events(db_url, gw.settings.data_dir, tenant_id)
    return [(name, data.get("path") or data.get("code")) for name, _, data in rows]


async def test_completion_records_auth_then_admission(tmp_path, db_url, llm):
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant()
        assert (await _chat(gw, key)).status_code == 200
        body = {"model": gw.runtime.engine.model_name, "prompt": "hi", "max_tokens": 1}
        r = await gw.client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
        assert r.status_code == 200, r.text
        assert [n for n, _ in await _events(gw, db_url, tid)] == [
            "auth.success", "request.admitted", "request.finished"] * 2
        paths = [p for n, p in await _events(gw, db_url, tid) if n == "auth.success"]
        assert paths == ["/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("body", [b"{not json", b'{"model": "x"}'])
async def test_a_request_refused_before_admission_still_records_auth(tmp_path, sqlite_url, llm, body):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant()
        headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
        r = await gw.client.post("/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert await _events(gw, sqlite_url, tid) == [("auth.success", "/v1/chat/completions")]


async def test_a_rate_limited_request_records_auth_before_its_rejection(tmp_path, db_url, llm):
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(requests_per_minute=1))
        assert (await _chat(gw, key)).status_code == 200
        assert (await _chat(gw, key)).status_code == 429
        names = [n for n, _ in await _events(gw, db_url, tid)]
        assert names == ["auth.success", "request.admitted", "request.finished",
                         "auth.success", "request.rejected"]


async def test_auth_is_recorded_when_the_admission_cannot_be_audited(tmp_path, sqlite_url, llm, monkeypatch):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant()
        with monkeypatch.context() as m:
            _fail_store_on(gw, m, "request.admitted")
            r = await _chat(gw, key)
        assert r.status_code == 503 and r.json()["error"]["code"] == "audit_unavailable"
        # The admission's transaction (with the deferred auth.success in it) rolled back; the
        # middleware then recorded auth.success on its own.
        assert await _events(gw, sqlite_url, tid) == [("auth.success", "/v1/chat/completions")]


async def test_other_routes_record_auth_before_the_handler(tmp_path, sqlite_url, llm, monkeypatch):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant()
        with monkeypatch.context() as m:
            _fail_store_on(gw, m, "auth.success")
            r = await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 503  # fails closed: no handler runs unaudited
        r = await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        assert await _events(gw, sqlite_url, tid) == [("auth.success", "/v1/models")]
