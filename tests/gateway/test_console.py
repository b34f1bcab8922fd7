"""The admin console at /admin on a real ``kvgate serve``: driven in Chromium end to end (sign in, tenant,
key used with the openai SDK, policy edit refusing the next request, usage chart, audit export verified),
and over plain HTTP for what must not work (no cookie, a wrong CSRF token, a read-only or revoked token)."""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import pytest

from audit.verify import verify_bundle
from gateway.app import create_app
from gateway.console.guard import CONSOLE_PUBLIC, CONSOLE_SCOPE, requires_console
from gateway.schemas.admin import ADMIN_READ, ADMIN_SCOPES

from .conftest import make_settings
from .console_browser import Page, browser_page, csrf_of, require_chromium, signed_in
from .served import Served, serve


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    data_dir = tmp_path_factory.mktemp("console")
    with serve(data_dir, tiny_model_dir, "--determinism-modes", "fast", "--num-kv-blocks", "64",
               "--max-num-seqs", "4") as s:
        yield s


def _openai(served: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=str(served.ca), timeout=60))


def _chat(client: openai.OpenAI, max_tokens: int = 4) -> object:
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, max_tokens=max_tokens,
                                          messages=[{"role": "user", "content": "Say hi"}])


def _tenant_count(served: Served) -> int:
    with served.admin() as admin:
        return len(admin.get("/admin/v1/tenants").json())


def test_every_console_route_is_guarded_scoped_and_out_of_the_schema(tmp_path: Path, sqlite_url: str) -> None:
    public, scoped = set(), set()
    for route in create_app(make_settings(tmp_path, sqlite_url)).routes:
        if not route.path_format.startswith("/admin") or route.path_format.startswith("/admin/v1"):
            continue
        for handler in route.route_handlers:
            assert requires_console in handler.resolve_guards() and not handler.resolve_include_in_schema()
            methods = set(handler.http_methods) - {"OPTIONS"}
            if handler.opt.get(CONSOLE_PUBLIC):
                public |= {(m, route.path_format) for m in methods}
            elif methods:
                scope = handler.opt[CONSOLE_SCOPE]
                assert scope in ADMIN_SCOPES
                assert methods == {"GET"} or scope != ADMIN_READ or route.path_format == "/admin/logout"
                scoped |= {(m, route.path_format) for m in methods}
    assert public == {("GET", "/admin/login"), ("POST", "/admin/login"), ("GET", "/admin/static/{file_path}"),
                      ("HEAD", "/admin/static/{file_path}")}
    assert len(scoped) >= 18


def _sign_in(page: Page, served: Served) -> None:
    page.goto(f"{served.base}/admin/tenants")
    assert page.url.endswith("/admin/login")
    page.fill("#token", "kvga_0000000000000000_" + "x" * 40)
    page.click("button[type=submit]")
    assert "not a valid admin token" in page.inner_text("main")
    page.fill("#token", served.admin_token)
    page.click("button[type=submit]")
    assert page.url.endswith("/admin/tenants")
    assert page.evaluate("document.cookie") == ""  # HttpOnly: no script sees the session
    assert page.evaluate("window.localStorage.length + window.sessionStorage.length") == 0


def _tenant_and_keys(page: Page, served: Served, stack: ExitStack) -> tuple[str, openai.OpenAI]:
    """Create a tenant and a key, rotate the key (the old one works through the overlap) and revoke the
    old one, disable and re-enable the tenant: each change seen by the SDK's next request."""
    page.fill("#name", "browser-co")
    page.click("text=Create tenant")
    tenant_id = page.url.rsplit("/", 1)[1]
    page.fill("#key-name", "sdk")
    page.click("text=Create key")
    old_key = page.inner_text("#new-key").strip()
    assert old_key.startswith("kvg_")
    page.click("text=Rotate")
    key = page.inner_text("#new-key").strip()
    page.click("button.copy")  # console.js, loaded under the CSP that allows no inline script
    assert page.evaluate("navigator.clipboard.readText()") == key
    assert key.startswith("kvg_") and key != old_key and "rotated to" in page.inner_text("table")
    _chat(stack.enter_context(_openai(served, old_key)))  # within the overlap
    page.locator("tr", has_text=old_key.split("_")[1]).locator("text=Revoke").click()
    with pytest.raises(openai.AuthenticationError):
        _chat(stack.enter_context(_openai(served, old_key)))
    page.reload()  # a GET: the secret is never shown again
    assert key not in page.content()
    page.click("#toggle-tenant")
    client = stack.enter_context(_openai(served, key))
    with pytest.raises(openai.AuthenticationError):
        _chat(client)
    page.click("#toggle-tenant")
    return tenant_id, client


def _usage_moves(page: Page, served: Served, tenant_id: str, client: openai.OpenAI) -> None:
    _chat(client)
    page.goto(f"{served.base}/admin/tenants/{tenant_id}/usage")
    requests_before = int(page.inner_text("#total-requests"))
    tokens_before, chart_before = int(page.inner_text("#total-tokens")), page.inner_html("figure.chart")
    assert requests_before >= 1 and tokens_before > 0 and page.locator("rect.bar").count() >= 2
    _chat(client)
    page.reload()
    assert int(page.inner_text("#total-requests")) == requests_before + 1
    assert int(page.inner_text("#total-tokens")) > tokens_before
    assert page.inner_html("figure.chart") != chart_before
    with page.expect_download() as csv_download:
        page.click("#csv-day")
    assert "num_requests" in Path(csv_download.value.path()).read_text()


def _policy_refuses(page: Page, served: Served, tenant_id: str, client: openai.OpenAI) -> None:
    page.goto(f"{served.base}/admin/tenants/{tenant_id}/policy")
    page.fill("#policy", '{"max_output_tokens": 0}')
    page.click("text=Save as version 2")
    assert "policy.max_output_tokens" in page.inner_text(".errors")
    page.fill("#policy", '{"max_output_tokens": 2}')
    page.fill("#comment", "short answers")
    page.click("text=Save as version 2")
    assert page.url.endswith("/policy/history")
    assert "max_output_tokens" in page.inner_text("#v2")
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, max_tokens=8)
    assert refused.value.code == "max_tokens_exceeded"


def _audit_export_verifies(page: Page, served: Served, tenant_id: str, tmp_path: Path) -> None:
    page.goto(f"{served.base}/admin/audit")
    page.select_option("#tenant", tenant_id)
    page.fill("#since", datetime.now(UTC).strftime("%Y-%m-%dT00:00:00"))
    page.click("text=Export and verify")
    assert page.inner_text("#verdict").startswith("Verified:")
    with page.expect_download() as download:
        page.click("#download")
    bundle = tmp_path / "bundle.tar"
    download.value.save_as(bundle)
    result = verify_bundle(bundle, (served.data_dir / "audit_public_key.pem").read_bytes())
    assert result.ok and result.is_key_pinned and result.tenant == tenant_id and result.num_events >= 10


def test_console_in_a_browser(served: Served, tmp_path: Path) -> None:
    require_chromium()
    shots = tmp_path / "screenshots"
    with ExitStack() as stack:
        page = stack.enter_context(browser_page(tmp_path))
        page.on("dialog", lambda dialog: dialog.accept())  # the confirmations of revoke and disable
        console_messages: list[str] = []
        page.on("console", lambda message: console_messages.append(message.text))

        def shot(name: str) -> None:
            page.screenshot(path=str(shots / f"{name}.png"), full_page=True)

        _sign_in(page, served)
        tenant_id, client = _tenant_and_keys(page, served, stack)
        shot("01-tenant")
        _usage_moves(page, served, tenant_id, client)
        shot("02-usage")
        _policy_refuses(page, served, tenant_id, client)
        shot("03-policy-history")
        page.goto(f"{served.base}/admin/engine")
        assert "/ 64" in page.inner_text("#kv-used")
        as_of = page.inner_text("#live .hint")
        page.wait_for_function("text => document.querySelector('#live .hint').innerText !== text", arg=as_of)
        shot("04-engine")
        _audit_export_verifies(page, served, tenant_id, tmp_path)
        shot("05-audit")
        page.click("text=Sign out")
        assert page.url.endswith("/admin/login")
        page.goto(f"{served.base}/admin/tenants")
        assert page.url.endswith("/admin/login")
        shot("06-signed-out")
    assert len(list(shots.glob("*.png"))) == 6
    assert not [m for m in console_messages if "Content Security Policy" in m], console_messages


def test_changes_need_the_session_cookie_and_its_csrf_token(served: Served) -> None:
    client, csrf = signed_in(served, served.admin_token)
    before = _tenant_count(served)
    with httpx.Client(base_url=served.base, verify=str(served.ca)) as anonymous:
        r = anonymous.post("/admin/tenants", data={"name": "no-cookie", "csrf_token": csrf})
    assert r.status_code == 401
    # one character changed (to a different one: a token that starts with "x" would stay right)
    for wrong in ({"csrf_token": ("y" if csrf[0] == "x" else "x") + csrf[1:]}, {}):
        r = client.post("/admin/tenants", data={"name": "bad-csrf", **wrong})
        assert r.status_code == 403 and "CSRF" in r.text
    r = client.post("/admin/tenants", data={"name": "bad-header"}, headers={"x-csrf-token": "nope"})
    assert r.status_code == 403
    assert _tenant_count(served) == before
    r = client.post("/admin/tenants", data={"name": "good-csrf", "csrf_token": csrf})
    assert r.status_code == 303 and _tenant_count(served) == before + 1
    page = client.get("/admin/tenants")
    assert page.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in page.headers[
        "content-security-policy"] and "script-src 'self'" in page.headers["content-security-policy"]
    scripts = re.findall(r"<script[^>]*>", page.text)
    assert scripts and all(" src=" in tag for tag in scripts)  # no inline script for the CSP to allow
    client.close()


def test_a_read_only_token_sees_but_cannot_change_and_revoking_it_ends_the_session(served: Served) -> None:
    with served.admin() as admin:
        made = admin.post("/admin/v1/admin-tokens", json={"name": "viewer", "scopes": ["admin:read"]}).json()
        tenant_id = admin.post("/admin/v1/tenants", json={"name": "viewed"}).json()["id"]
    client, csrf = signed_in(served, made["token"])
    page = client.get(f"/admin/tenants/{tenant_id}/policy")
    assert page.status_code == 200 and "readonly" in page.text and "Save as version" not in page.text
    r = client.post(f"/admin/tenants/{tenant_id}/policy",
                    data={"policy": "{}", "expected_version": "1", "csrf_token": csrf})
    assert r.status_code == 403 and "policy:write" in r.text
    assert client.post(f"/admin/tenants/{tenant_id}/disable", data={"csrf_token": csrf}).status_code == 403
    assert client.get("/admin/audit").status_code == 403  # audit:export
    csv = client.get(f"/admin/tenants/{tenant_id}/usage/csv", params={"window": "minute"})
    assert csv.status_code == 200 and csv.text.startswith("tenant_id,window,window_start,num_requests")
    assert client.get(f"/admin/tenants/{tenant_id}/usage/csv", params={"window": "week"}).status_code == 400
    assert client.get(f"/admin/tenants/{tenant_id}/usage", params={"window": "week"}).status_code == 400
    with served.admin() as admin:
        assert admin.get(f"/admin/v1/tenants/{tenant_id}/policy").json()["version"] == 1
        assert not admin.get(f"/admin/v1/tenants/{tenant_id}").json()["is_disabled"]
        admin.post(f"/admin/v1/admin-tokens/{made['info']['id']}/revoke").raise_for_status()
    r = client.get("/admin/tenants")
    client.close()
    assert r.status_code == 303 and r.headers["location"] == "/admin/login"


def _audit_rows(served: Served, *names: str) -> list[tuple[str, str | None, str | None, str]]:
    with sqlite3.connect(served.data_dir / "kvgate.db") as db:
        marks = ",".join("?" * len(names))
        return db.execute(f"SELECT name, actor, key_id, data FROM audit_events WHERE name IN ({marks}) "
                          "ORDER BY seq", names).fetchall()


def test_sign_out_ends_the_session_even_for_a_kept_cookie(served: Served) -> None:
    token_id = served.admin_token.split("_")[1]
    client, csrf = signed_in(served, served.admin_token)
    assert client.post("/admin/tenants", data={"name": "audited", "csrf_token": csrf}).status_code == 303
    kept = dict(client.cookies)
    assert client.post("/admin/logout", data={"csrf_token": csrf}).status_code == 303
    client.close()
    tenant_key = served.make_key("key-holder")
    with httpx.Client(base_url=served.base, verify=str(served.ca), cookies=kept) as replay:
        r = replay.get("/admin/tenants")
        assert r.status_code == 303 and r.headers["location"] == "/admin/login"
        form = replay.get("/admin/login")
        r = replay.post("/admin/login", data={"token": tenant_key, "csrf_token": csrf_of(form.text)})
    assert r.status_code == 401 and "__Host-kvgate_console=" not in r.headers.get("set-cookie", "")
    # Audited as the API's changes are: the change names the token that signed in as its actor.
    rows = _audit_rows(served, "auth.success", "admin.tenant_created", "admin.console_signed_out")
    assert any(n == "auth.success" and k == token_id and '"/admin/login"' in d for n, _, k, d in rows)
    assert ("admin.tenant_created", token_id) in {(n, a) for n, a, _, _ in rows}
    assert ("admin.console_signed_out", token_id) in {(n, a) for n, a, _, _ in rows}


def _retained_ids(client: httpx.Client, tenant_id: str) -> list[str]:
    """The tenant's record ids on the console's page, once its request's record is written (after the
    response, so polled)."""
    deadline = time.monotonic() + 30
    while True:
        page = client.get(f"/admin/tenants/{tenant_id}/retention").text
        found = re.findall(r'/retention/([\w-]+)" class="inline"', page)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_reading_a_retained_prompt_needs_retention_read_and_a_reason(served: Served) -> None:
    with served.admin() as admin:
        policy = {"prompt_retention_days": 1}
        tenant_id = admin.post("/admin/v1/tenants", json={"name": "kept", "policy": policy}).json()["id"]
        key = admin.post(f"/admin/v1/tenants/{tenant_id}/keys", json={}).json()["key"]
        viewer = admin.post("/admin/v1/admin-tokens", json={"name": "v", "scopes": ["admin:read"]}).json()
    with _openai(served, key) as client:
        _chat(client)
    reader, csrf = signed_in(served, served.admin_token)
    (record_id,) = _retained_ids(reader, tenant_id)
    url = f"/admin/tenants/{tenant_id}/retention/{record_id}"
    r = reader.post(url, data={"reason": "", "csrf_token": csrf})
    assert r.status_code == 400 and "reason" in r.text and "Say hi" not in r.text
    r = reader.post(url, data={"reason": "support ticket 42", "csrf_token": csrf})
    assert r.status_code == 200 and "Say hi" in r.text
    reader.close()
    looker, looker_csrf = signed_in(served, viewer["token"])
    listed = looker.get(f"/admin/tenants/{tenant_id}/retention").text
    assert record_id in listed and 'name="reason"' not in listed  # listed, with no form to read it
    r = looker.post(url, data={"reason": "curiosity", "csrf_token": looker_csrf})
    looker.close()
    assert r.status_code == 403 and "retention:read" in r.text and "Say hi" not in r.text
    reads = _audit_rows(served, "retention.record_read")
    token_id = served.admin_token.split("_")[1]
    assert [(a, '"support ticket 42"' in d) for _, a, _, d in reads] == [(token_id, True)]
