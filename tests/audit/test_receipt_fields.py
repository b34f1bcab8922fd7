"""Receipt fields survive redaction (log sink) and the store's scrubbing unchanged; nothing else new does."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from audit.context import clear_request_context, register_sensitive
from audit.events import REQUEST_FINISHED, make_event
from audit.patterns import is_digest_field
from audit.redact import NOT_ALLOWED, Redactor
from audit.store import AuditStore

# A digest with a Luhn-valid 16-digit run (4111...) and the letters of a short registered "prompt".
UNLUCKY = "4111111111111111beefcafe00ab12cd"
RECEIPT = {
    "kind": "chat", "model": "m", "determinism": "batch_invariant",
    "system_fingerprint": "fp_4111111111111111", "prompt_hash": UNLUCKY, "num_choices": 1, "max_tokens": 8,
    "temperature": 0.7, "top_p": 0.9, "top_k": 5,
    "seed": 12345, "stop": ["END"], "arrival_step": 3, "token_hashes": [UNLUCKY],
}


def test_receipt_fields_pass_the_log_redactor_unchanged() -> None:
    clear_request_context()
    register_sensitive("beefcafe")
    try:
        with capture_logs(processors=[Redactor()]) as logs:
            structlog.get_logger().info(REQUEST_FINISHED, **RECEIPT, surprise="x")
    finally:
        clear_request_context()
    [line] = logs
    assert {k: line[k] for k in RECEIPT} == RECEIPT
    assert line["surprise"] == NOT_ALLOWED


def test_only_pure_digests_skip_scrubbing() -> None:
    assert is_digest_field("token_hashes", [UNLUCKY])
    assert is_digest_field("system_fingerprint", "fp_0a1b2c3d4e5f6a7b")
    assert not is_digest_field("token_hashes", ["card 4111 1111 1111 1111"])
    assert not is_digest_field("token_hashes", []) and not is_digest_field("stop", UNLUCKY)
    line = Redactor()(None, "info", {"event": "x", "token_hashes": ["4111 1111 1111 1111"]})
    assert line["token_hashes"] == ["[REDACTED:card]"]


async def test_store_keeps_digests_intact(store: AuditStore) -> None:
    register_sensitive("beefcafe")
    try:
        await store.append(make_event(REQUEST_FINISHED, request_id="r1", **RECEIPT))
    finally:
        clear_request_context()
    [record] = [r async for r in store.iter_records(1, 1)]
    assert record["data"] == RECEIPT
