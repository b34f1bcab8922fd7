"""The console's pure parts: session cookies and CSRF tokens, chart geometry and buckets, policy diffs and
form validation."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from litestar import Litestar, Router, get
from litestar.testing import TestClient

from gateway.audit_hook import AuditUnavailableError
from gateway.console import charts, session
from gateway.console.forms import FormErrors, validate
from gateway.console.policies import diff
from gateway.console.session import SessionSigner
from gateway.console.views import EXCEPTION_HANDLERS
from gateway.errors import Conflict
from gateway.principal import Principal
from gateway.schemas.admin import KeyCreate, PolicyOut, UsageRow
from gateway.secrets import Hasher
from policies import Policy

ADMIN = Principal(kind="admin", key_id="ab" * 8, scopes=frozenset({"admin:read", "keys:write"}))


def _signer(byte: bytes = b"p") -> SessionSigner:
    return SessionSigner(Hasher(byte * 32))


def test_a_session_cookie_round_trips_and_any_change_to_it_is_refused() -> None:
    signer = _signer()
    issued, cookie = signer.issue(ADMIN)
    assert signer.parse(cookie) == issued and issued.principal.scopes == ADMIN.scopes
    payload, mac = cookie.split(".")
    forged = session._b64(session._unb64(payload).replace(b'"admin:read"', b'"tokens:write"'))
    for bad in (f"{forged}.{mac}", f"{payload}.{mac[:-2]}AA", payload, "", "x" * 5000, f"{payload}.{mac}.x"):
        assert signer.parse(bad) is None, bad
    assert _signer(b"q").parse(cookie) is None  # another server's pepper


def test_a_session_ends_at_its_expiry_or_its_tokens(monkeypatch) -> None:
    signer = _signer()
    issued, cookie = signer.issue(ADMIN)
    assert issued.expires_at - time.time() == pytest.approx(session.SESSION_S, abs=2)
    soon = datetime.now(UTC) + timedelta(seconds=90)
    short, _ = signer.issue(Principal(kind="admin", key_id="cd" * 8, scopes=ADMIN.scopes, expires_at=soon))
    assert short.expires_at == int(soon.timestamp())
    later = time.time() + session.SESSION_S + 1
    monkeypatch.setattr(session.time, "time", lambda: later)
    assert signer.parse(cookie) is None
    monkeypatch.undo()
    assert signer.parse(cookie) == issued  # signing out is the database's (test_console_replicas.py)


def test_csrf_tokens_are_per_session_and_checked_in_constant_time() -> None:
    signer = _signer()
    one, two = signer.issue(ADMIN)[0], signer.issue(ADMIN)[0]
    assert signer.csrf(one) != signer.csrf(two) and signer.csrf(one) == signer.csrf(one)
    assert SessionSigner.is_same(signer.csrf(one), signer.csrf(one))
    assert not SessionSigner.is_same(signer.csrf(one), signer.csrf(two))
    assert not SessionSigner.is_same(signer.csrf(one), None)
    assert signer.login_csrf("n") != signer.csrf(one)


def test_bars_stack_and_scale_to_a_round_top() -> None:
    chart = charts.bar_chart("t", ["a", "b", "c"], [("x", "#000", [3, 0, 1]), ("y", "#fff", [1, 0, 0])])
    assert chart.y_max == 5
    assert [charts._nice_ceiling(v) for v in (0, 1, 3, 7, 11, 180)] == [1, 1, 5, 10, 20, 200]
    assert len(chart.bars) == 3  # no bar for a zero
    x_a, y_a, x_c = chart.bars[0], chart.bars[1], chart.bars[2]
    assert y_a.y + y_a.height == pytest.approx(x_a.y)  # y sits on top of x in the same column
    assert x_a.height == pytest.approx(3 * x_c.height)


def _row(at: datetime, requests: int, prompt: int) -> UsageRow:
    return UsageRow(tenant_id="t", window="minute", window_start=at, num_requests=requests,
                    prompt_tokens=prompt, completion_tokens=1, cached_tokens=0, total_tokens=prompt + 1)


def test_minute_rows_fold_into_their_hour_and_rows_outside_are_left_out() -> None:
    now = datetime(2026, 11, 26, 10, 30, tzinfo=UTC)
    starts = charts.buckets("hour", now, 3)
    assert starts == [datetime(2026, 11, 26, h, tzinfo=UTC) for h in (8, 9, 10)]
    rows = [_row(now, 1, 10), _row(now - timedelta(minutes=20), 2, 5), _row(now - timedelta(hours=1), 4, 7),
            _row(now - timedelta(hours=5), 100, 100)]
    sums = charts.per_bucket(rows, starts, "hour")
    assert sums["requests"] == [0, 4, 3] and sums["prompt"] == [0, 7, 15] and sums["completion"] == [0, 1, 2]
    days = charts.buckets("day", now, 2)
    assert charts.per_bucket(rows, days, "day")["requests"] == [0, 107]


def _version(n: int, policy: Policy) -> PolicyOut:
    return PolicyOut(tenant_id="t", version=n, policy=policy, changed_by="x", comment="",
                     created_at=datetime.now(UTC))


def test_a_policy_diff_lists_only_the_fields_that_changed() -> None:
    v1 = _version(1, Policy())
    v2 = _version(2, Policy(max_output_tokens=2, requests_per_minute=5))
    changes = {c.field: (c.before, c.after) for c in diff(v1, v2)}
    assert changes == {"max_output_tokens": ("null", "2"), "requests_per_minute": ("null", "5")}
    assert diff(v2, v2) == [] and len(diff(None, v1)) == len(Policy.model_fields)


def test_form_validation_reports_every_error_by_field() -> None:
    with pytest.raises(FormErrors) as e:
        validate(KeyCreate, {"name": "x" * 200, "expires_in_seconds": 0})
    assert {field for field, _ in e.value.errors} == {"name", "expires_in_seconds"}


def _raises(exc: Exception):
    @get("/boom", sync_to_thread=False)
    def boom() -> None:
        raise exc

    return boom


@pytest.mark.parametrize(("exc", "status", "text"), [
    (AuditUnavailableError("admin.tenant_created"), 503, "audit trail is unavailable"),
    (RuntimeError("secret detail"), 500, "Internal server error"),
    (Conflict("Policy is at version 2, not 1.", code="version_conflict"), 409, "Policy is at version 2"),
])
def test_errors_are_pages_with_the_apis_status_and_never_an_exceptions_text(exc, status, text) -> None:
    router = Router("/admin", route_handlers=[_raises(exc)], exception_handlers=EXCEPTION_HANDLERS)
    with TestClient(Litestar([router], logging_config=None)) as client:
        r = client.get("/admin/boom")
    assert r.status_code == status and r.headers["content-type"].startswith("text/html")
    assert text in r.text and "secret detail" not in r.text and r.headers["x-frame-options"] == "DENY"
