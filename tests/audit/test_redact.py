"""Redaction: allow-list, content hashing and secret scrubbing in logs (capture_logs and the real chain)."""

from __future__ import annotations

import io
import logging

import orjson
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from audit.context import bind_request_context, clear_request_context, get_sensitive, register_sensitive
from audit.logging import configure_logging
from audit.patterns import ADMIN_TOKEN_FORMAT, KVG_KEY_FORMAT, scrub_text
from audit.redact import NOT_ALLOWED, Redactor

CANARY = "CANARY-7f3a9c-do-not-log"
KVG_KEY = "kvg_0123456789abcdef_Q2FuYXJ5U2VjcmV0VmFsdWUxMjM0NTY"
ADMIN = "kvga_fedcba9876543210_QWRtaW5TZWNyZXRWYWx1ZTEyMzQ1Ng"
SECRETS = [
    KVG_KEY.split("_", 2)[2], ADMIN.split("_", 2)[2], "sk-proj-abcdefghijklmnop1234", "AKIAIOSFODNN7EXAMPLE",
    "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "xoxb-123456789012-abcdefghij", "alice@example.com",
    "4111 1111 1111 1111", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl",
]
# As they would appear in the wild (the first two entries above are only the secret halves).
FULL_SECRETS = [KVG_KEY, ADMIN, *SECRETS[2:]]


@pytest.fixture(autouse=True)
def _clean_context():
    clear_request_context()
    yield
    clear_request_context()
    structlog.reset_defaults()


def test_token_formats_match_the_gateway() -> None:
    from gateway.secrets import ADMIN_PREFIX, TENANT_PREFIX, new_token

    assert KVG_KEY_FORMAT.match(new_token(TENANT_PREFIX)[2])
    assert ADMIN_TOKEN_FORMAT.match(new_token(ADMIN_PREFIX)[2])
    assert KVG_KEY_FORMAT.match(KVG_KEY) and ADMIN_TOKEN_FORMAT.match(ADMIN)


@pytest.mark.parametrize("text", [
    f"Authorization: Bearer {KVG_KEY}", f"key={KVG_KEY}", f"x-admin-token: {ADMIN}",
    "token sk-ant-abcdefghijklmnopqrstu",
    "aws AKIAIOSFODNN7EXAMPLE", "mail alice@example.com", "card 4111-1111-1111-1111", "card 378282246310005",
    "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "Basic dXNlcjpwYXNzd29yZA==",
    "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIK\n-----END PRIVATE KEY-----",
])
def test_scrub_text_removes_secrets(text: str) -> None:
    out = scrub_text(text)
    for secret in [*SECRETS, "dXNlcjpwYXNzd29yZA", "MC4CAQAwBQYDK2VwBCIEIK", "378282246310005",
                   "abcdefghijklmnopqrstu"]:
        assert secret not in out, out


def test_scrub_keeps_harmless_numbers_and_key_ids() -> None:
    assert scrub_text("order 4111111111111112 total 12") == "order 4111111111111112 total 12"  # not Luhn
    assert scrub_text(KVG_KEY) == "kvg_0123456789abcdef_[REDACTED]"


def test_redactor_with_capture_logs() -> None:
    redactor = Redactor(hash_key=b"k" * 32)
    with capture_logs(processors=[structlog.contextvars.merge_contextvars, redactor]) as logs:
        bind_request_context(request_id="req-1", tenant_id="t1", key_id="0123456789abcdef")
        structlog.get_logger().info(
            "completion", prompt=f"hello {CANARY}", messages=[{"role": "user", "content": CANARY}],
            headers={"Authorization": f"Bearer {KVG_KEY}", "x-request-id": "abc"},
            num_prompt_tokens=3, user_email="bob@example.com", error=f"failed for {CANARY} {ADMIN}",
            nested={"deep": [{"text": CANARY}]},
        )
    (entry,) = logs
    summary = redactor.summarize(f"hello {CANARY}")
    assert entry["prompt"] == {"len": len(f"hello {CANARY}"), "hmac": summary["hmac"]}
    assert set(entry["messages"]) == {"len", "hmac"}
    assert entry["headers"] == {"Authorization": "[REDACTED]", "x-request-id": "abc"}
    assert entry["num_prompt_tokens"] == 3 and entry["request_id"] == "req-1"
    assert entry["user_email"] == NOT_ALLOWED and entry["nested"] == NOT_ALLOWED
    dumped = orjson.dumps(entry, default=str).decode()
    assert ADMIN.split("_", 2)[2] not in dumped and KVG_KEY.split("_", 2)[2] not in dumped
    assert CANARY in entry["error"]  # not registered as sensitive: only secret patterns are scrubbed
    register_sensitive(CANARY)
    assert CANARY not in redactor(None, "info", {"error": f"x {CANARY!r} y"})["error"]


def test_ids_in_log_lines_survive_a_prompt_that_equals_them() -> None:
    redactor = Redactor(hash_key=b"k" * 32)
    with capture_logs(processors=[structlog.contextvars.merge_contextvars, redactor]) as logs:
        bind_request_context(request_id="req-77f3", tenant_id="tenant-4f2a9c1e", key_id="0123456789abcdef")
        register_sensitive("tenant-4f2a9c1e", "0123456789abcdef", "req-77f3")
        structlog.get_logger().info("completion", error="failed for tenant-4f2a9c1e")
    (entry,) = logs
    assert (entry["request_id"], entry["tenant_id"], entry["key_id"]) == (
        "req-77f3", "tenant-4f2a9c1e", "0123456789abcdef")
    assert entry["error"] == "failed for [REDACTED:content]"
    assert redactor(None, "info", {"key_id": KVG_KEY})["key_id"] == "kvg_0123456789abcdef_[REDACTED]"


def _boom(prompt: str) -> None:
    raise ValueError(f"model rejected prompt {prompt!r} for key {KVG_KEY} (contact alice@example.com)")


def test_real_chain_never_writes_canary_or_secrets() -> None:
    buf = io.BytesIO()
    configure_logging(json=True, level="DEBUG", stream=buf, hash_key=b"h" * 32)
    log = structlog.get_logger("kvgate.test")
    prompt = f"Summarize this: {CANARY}\nsecond line {CANARY}"
    bind_request_context(request_id="r-9", tenant_id="t-9", key_id="0123456789abcdef")
    register_sensitive(prompt)
    log.info("request", prompt=prompt, headers={"authorization": f"Bearer {KVG_KEY}"},
             body={"messages": [{"content": prompt}]}, path=f"/v1/chat?api_key={KVG_KEY}")
    try:
        _boom(prompt)
    except ValueError:
        log.exception("request failed", error=f"{FULL_SECRETS}")
        logging.getLogger("uvicorn.error").exception("ASGI error with %s", ADMIN)
    logging.getLogger("litestar").warning("headers %s", [(b"authorization", f"Bearer {ADMIN}".encode())])
    logging.getLogger("uvicorn.access").info('127.0.0.1 - "GET /x?token=%s HTTP/1.1" 200', KVG_KEY)
    out = buf.getvalue().decode()
    lines = [orjson.loads(line) for line in out.splitlines()]
    assert len(lines) == 5
    assert all(line["request_id"] == "r-9" and line["timestamp"].endswith("Z") for line in lines)
    assert "Traceback" in lines[1]["exception"] and "ValueError" in lines[1]["exception"]
    assert {line.get("logger") for line in lines[2:]} == {"uvicorn.error", "litestar", "uvicorn.access"}
    for needle in [CANARY, *SECRETS, "second line"]:
        assert needle not in out, needle


def test_console_renderer_and_level_filter() -> None:
    buf = io.BytesIO()
    configure_logging(json=False, level="WARNING", stream=buf)
    structlog.get_logger().info("hidden", prompt=CANARY)
    structlog.get_logger().warning("shown", prompt=CANARY, key_id="k")
    out = buf.getvalue().decode()
    assert "hidden" not in out and "shown" in out and CANARY not in out


def test_digit_runs_inside_identifiers_are_not_card_numbers():
    # A random hex id once carried the Luhn-valid run 895105932090710 and was mangled in an audit record.
    assert scrub_text("record 1cd895105932090710ceaf1b41f72004") == "record 1cd895105932090710ceaf1b41f72004"
    assert scrub_text("card 4111 1111 1111 1111.") == "card [REDACTED:card]."


@pytest.mark.parametrize("text", [
    "4111  1111  1111  1111", "4111 - 1111 - 1111 - 1111", "4111\u00a01111\u00a01111\u00a01111",
    "4111\u20131111\u20131111\u20131111", "\uff14" + "\uff11" * 15, "3782 822463 10005",
])
def test_card_numbers_in_other_spacings_and_digits_are_removed(text: str) -> None:
    assert scrub_text(f"pay with {text} now") == "pay with [REDACTED:card] now"


def test_dotted_and_slashed_digit_runs_are_not_card_numbers() -> None:
    # 17324400001234561 is Luhn-valid: an epoch time with decimals must survive as it is.
    for text in ("t=1732440000.1234561 s", "4111.1111.1111.1111", "4111/1111/1111/1111"):
        assert scrub_text(text) == text


def _scrub_every_pattern(text: str) -> str:
    """scrub_text without its one-scan shortcut: every substitution, always."""
    from audit.patterns import _CARD_RE, _SUBSTITUTIONS, _card_sub

    for pattern, replacement in _SUBSTITUTIONS:
        text = pattern.sub(replacement, text)
    return _CARD_RE.sub(_card_sub, text)


_FRAGMENTS = [*FULL_SECRETS, "Authorization", ": ", "=", "Bearer ", "token ", "password=", "-----BEGIN ",
              "RSA PRIVATE KEY-----", "kvg_", "kvga_", "sk-", "@", ".", "4111", " ", "-", "\n", "1234567890",
              "abc", "é", "f" * 20, "eyJ", "AKIA", "x"]


@given(st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=8), max_size=12).map("".join))
@settings(max_examples=400, deadline=None)
def test_the_one_scan_shortcut_never_changes_the_result(text: str) -> None:
    assert scrub_text(text) == _scrub_every_pattern(text)


_PROMPT_PARTS = ["Tell me about ", "line one is long enough\n", "tab\there", "quote ' and \" ", "é ü 😀 ",
                 "back\\slash ", "\r\n", "x" * 9]
_PROMPTS = st.lists(st.sampled_from(_PROMPT_PARTS) | st.text(max_size=12), min_size=1, max_size=6)


@given(_PROMPTS.map("".join).filter(bool),
       st.sampled_from(["{}", "{!r}", "{!a}", "[{}]", "json: {}", "err: {}"]))
@settings(max_examples=300, deadline=None)
def test_a_registered_value_scrubs_as_the_plain_string_does(prompt: str, shape: str) -> None:
    """``register_sensitive`` works out a value's escaped and per-line forms once; scrubbing with them
    must give what working them out for every scrubbed string gives."""
    register_sensitive(prompt)
    [marked] = get_sensitive()
    assert marked == prompt and marked is not prompt
    texts = [shape.format(prompt), orjson.dumps({"p": prompt}).decode(), *prompt.splitlines()]
    for text in texts:
        assert scrub_text(text, (marked,)) == scrub_text(text, (str(prompt),))
    if len(prompt) >= 4 and prompt not in "[REDACTED:content]":
        assert prompt not in scrub_text(shape.format(prompt), (marked,))
    clear_request_context()


def test_only_short_clean_strings_are_remembered_and_prompts_are_still_scrubbed() -> None:
    from audit import patterns

    patterns._CLEAN.clear()
    assert scrub_text("tenant 1234 said hello there") == "tenant 1234 said hello there"
    assert "tenant 1234 said hello there" in patterns._CLEAN
    for secret in FULL_SECRETS:  # a string a pattern matched is never kept, and is scrubbed every time
        assert scrub_text(secret) == scrub_text(secret) != secret
        assert secret not in patterns._CLEAN
    longer = "plain words " * 20
    assert scrub_text(longer) == longer and longer not in patterns._CLEAN
    register_sensitive("said hello there")  # remembered as clean, it still loses a registered prompt
    assert scrub_text("tenant 1234 said hello there", get_sensitive()) == "tenant 1234 [REDACTED:content]"
    for i in range(patterns._CLEAN_MAX_ENTRIES + 10):
        scrub_text(f"id-{i}")
    assert len(patterns._CLEAN) <= patterns._CLEAN_MAX_ENTRIES
