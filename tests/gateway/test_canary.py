"""Redaction canary: a marker and secrets sent every way we can think of never reach a log line, a
database row (retention holds them only as ciphertext) or an export bundle, with retention off or on."""

import io
import logging
import secrets

import orjson
import pytest
import structlog
from sqlalchemy import inspect, select, text

from audit.logging import configure_logging
from gateway.tenancy import keys

from .conftest import open_gateway

MARKER = f"CANARY-{secrets.token_hex(10)}"
PROVIDER_KEY = f"sk-proj-{secrets.token_hex(16)}"
EMAIL = f"canary.{secrets.token_hex(4)}@example.org"
CARD = "4111 1111 1111 1111"  # a Luhn-valid test number
FAKE_KVG = f"kvg_0123456789abcdef_{secrets.token_hex(16)}"


@pytest.fixture
def log_buffer(restore_logging) -> io.BytesIO:
    buf = io.BytesIO()
    configure_logging(json=True, level="DEBUG", stream=buf)
    # Resolve loggers on every call: a logger cached by an earlier test would write to its old stream.
    structlog.configure(cache_logger_on_first_use=False)
    # The test client's own request log (httpx) is the caller's, not the gateway's: keep it out.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return buf


def _payload(key: str) -> str:
    return f"{MARKER}: my key is {key}, provider key {PROVIDER_KEY}, card {CARD}, mail me at {EMAIL}"


async def _admin_setup(gw, retention_days: int) -> tuple[str, str]:
    h = gw.admin()
    policy = {"prompt_retention_days": retention_days}
    r = await gw.client.post("/admin/v1/tenants", headers=h, json={"name": "canary", "policy": policy})
    tid = r.json()["id"]
    r = await gw.client.post(f"/admin/v1/tenants/{tid}/keys", headers=h, json={"name": "ci"})
    return tid, r.json()["key"]


async def _good_requests(gw, key: str) -> None:
    model = gw.runtime.engine.model_name
    headers = {"Authorization": f"Bearer {key}", "X-Canary": MARKER, "User-Agent": f"canary/{MARKER}",
               "X-Api-Key": PROVIDER_KEY, "Cookie": f"session={MARKER}; email={EMAIL}"}
    chat = {"model": model, "max_tokens": 3, "user": EMAIL, "messages": [
        {"role": "system", "content": f"The user is {EMAIL}."}, {"role": "user", "content": _payload(key)}]}
    assert (await gw.client.post("/v1/chat/completions", headers=headers, json=chat)).status_code == 200
    text_req = {"model": model, "max_tokens": 3, "prompt": _payload(key), "stream": True,
                "stream_options": {"include_usage": True}}
    assert (await gw.client.post("/v1/completions", headers=headers, json=text_req)).status_code == 200


async def _failing_requests(gw, key: str) -> None:
    model, chat = gw.runtime.engine.model_name, "/v1/chat/completions"
    h = {"Authorization": f"Bearer {key}", "X-Canary": MARKER}
    msgs = [{"role": "user", "content": _payload(key)}]
    too_long = {"model": model, "prompt": _payload(key) * 400}
    expected = [  # (method, path, request kwargs, status)
        ("post", chat, {"headers": h, "json": {"model": f"{MARKER}-model", "messages": msgs}}, 404),
        ("post", chat, {"headers": h, "content": f'{{"model": "{model}", "messages": [{MARKER}'}, 400),
        ("post", chat, {"headers": h, "json": {"model": model, "messages": [{"role": MARKER}]}}, 400),
        ("post", "/v1/completions", {"headers": h, "json": too_long}, 400),
        ("get", f"/v1/models/{MARKER}", {"headers": h}, 404),
        ("get", "/v1/models", {"headers": {"Authorization": f"Bearer {PROVIDER_KEY}"}}, 401),
        ("get", "/v1/models", {"headers": {"Authorization": f"Bearer {FAKE_KVG}{MARKER}"}}, 401),
        ("get", "/admin/v1/tenants", {"headers": {"Authorization": f"Bearer {key}"}}, 403),
    ]
    for method, path, kwargs, status in expected:
        r = await getattr(gw.client, method)(path, **kwargs)
        assert r.status_code == status, (path, r.text)
    await _audit_fails_at_admission(gw, h, {"model": model, "max_tokens": 2, "messages": msgs})


async def _audit_fails_at_admission(gw, headers: dict, body: dict) -> None:
    """A real store failure after the prompt is parsed: a 503 whose traceback gets logged."""
    async with gw.runtime.db.begin() as conn:
        await conn.execute(text(
            "CREATE TRIGGER canary_fail BEFORE INSERT ON audit_events WHEN NEW.name = 'request.admitted' "
            "BEGIN SELECT RAISE(ABORT, 'audit disk full'); END"))
    try:
        r = await gw.client.post("/v1/chat/completions", headers=headers, json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "audit_unavailable"
    finally:
        async with gw.runtime.db.begin() as conn:
            await conn.execute(text("DROP TRIGGER canary_fail"))


async def _read_retained(gw, tid: str) -> list[dict]:
    rt = gw.runtime
    async with rt.sessionmaker() as s:
        token = await keys.create_admin_token(s, rt.hasher, "dpo", frozenset({keys.RETENTION_READ}))
    h = {"Authorization": f"Bearer {token}"}
    listed = (await gw.client.get(f"/admin/v1/tenants/{tid}/retention", headers=gw.admin())).json()
    return [(await gw.client.get(f"/admin/v1/tenants/{tid}/retention/{rec['id']}", headers=h,
                                 params={"reason": "canary check"})).json() for rec in listed]


async def _dump_database(gw) -> dict[str, list[tuple]]:
    async with gw.runtime.db.connect() as conn:
        names = await conn.run_sync(lambda c: inspect(c).get_table_names())
        return {name: [tuple(row) for row in (await conn.execute(select(text("*")).select_from(
            text(f'"{name}"')))).all()] for name in names}


async def _exports(gw) -> list[bytes]:
    bundles = []
    for fmt in ("jsonl", "csv"):
        r = await gw.client.get("/admin/v1/audit/export", headers=gw.admin(), params={"format": fmt})
        assert r.status_code == 200, r.text
        bundles.append(r.content)
    return bundles


def _needles(key: str, admin_token: str) -> list[str]:
    return [MARKER, key.split("_", 2)[2], admin_token.split("_", 2)[2], PROVIDER_KEY, EMAIL, CARD,
            CARD.replace(" ", ""), FAKE_KVG.split("_", 2)[2]]


def _assert_absent(where: str, blob: bytes, needles: list[str]) -> None:
    for needle in needles:
        assert needle.encode() not in blob, f"{needle!r} found in {where}"


@pytest.mark.parametrize("retention_days", [0, 7], ids=["retention-off", "retention-on"])
async def test_canary_never_reaches_logs_db_or_exports(tmp_path, sqlite_url, llm, log_buffer, retention_days):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await _admin_setup(gw, retention_days)
        await _good_requests(gw, key)
        await _failing_requests(gw, key)
        retained = await _read_retained(gw, tid)
        bundles = await _exports(gw)
        tables = await _dump_database(gw)
    needles = _needles(key, gw.admin_token)
    # Retention keeps exactly what was sent, and only as ciphertext (plaintext only through the API).
    assert len(retained) == (2 if retention_days else 0)
    assert all(MARKER in orjson.dumps(r["prompt"]).decode() for r in retained)
    assert len(tables["retained_prompts"]) == len(retained)
    for name, rows in tables.items():
        for row in rows:
            for value in row:
                blob = value if isinstance(value, bytes) else str(value).encode()
                _assert_absent(f"table {name}", blob, needles)
    for blob in bundles:
        _assert_absent("export bundle", blob, needles)
    logs = log_buffer.getvalue()
    _assert_absent("logs", logs, needles)
    lines = [orjson.loads(line) for line in logs.splitlines()]
    # Not vacuous: the failing request's traceback and the engine/database chatter were captured.
    (failure,) = [line for line in lines if line["event"] == "audit.unavailable"]
    assert "Traceback" in failure["exception"] and "audit disk full" in failure["exception"]
    assert failure["tenant_id"] == tid and failure["request_id"]
    names = {row[3] for row in tables["audit_events"]}  # (seq, event_id, ts, name, ...)
    assert {"auth.failure", "auth.success", "request.admitted", "request.rejected", "request.finished",
            "audit.exported"} <= names
