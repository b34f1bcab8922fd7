"""Redaction cost: linear in the text on adversarial input, bounded on log lines, off the event loop for
large audit events; with the same results as the plain patterns."""

from __future__ import annotations

import re
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from audit.context import clear_request_context, register_sensitive
from audit.events import ADMIN_ACTION, make_event
from audit.patterns import _SUBSTITUTIONS, scrub_text
from audit.redact import Redactor
from audit.sensitive import SensitiveSet, scrub_sensitive, sensitive
from audit.store import AuditStore
from audit.tables import audit_events

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
TAIL = (" mail alice@example.com card 4111 1111 1111 1111 key sk-proj-abcdefghijklmnop1234 "
        "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl")
REDACTED_TAIL = " mail [REDACTED:email] card [REDACTED:card] key [REDACTED:api-key] jwt [REDACTED:jwt]"
# Near misses that a backtracking pattern would retry at every position; none holds a secret itself.
ADVERSARIAL = {
    "email-local-run": "a" * MIB,
    "email-at-signs": "a@" * (MIB // 2),
    "email-one-letter-tlds": "a@b." * (MIB // 4),
    "email-digit-led-labels": "x@" + "1a1." * (MIB // 4),
    "email-dotted-run": "a." * (MIB // 2),
    "email-punctuation-run": "%+." * (MIB // 3),
    "jwt-starts-in-one-run": "eyJ-" * (MIB // 4),
    "jwt-short-segments": "eyJaaaa." * (MIB // 8),
    "card-digit-run": "0" * MIB,
    "card-digits-too-far-apart": "1    " * (MIB // 5),
    "header-names": "token " * (MIB // 6),
    "header-name-then-spaces": "password" + " " * MIB,
    "private-key-headers": "PRIVATE KEY----- " + ("-----BEGIN " + "A " * 100) * (MIB // 211),
    "kvgate-key-ids-too-long": ("kvg_" + "a" * 70 + " ") * (MIB // 75),
    "api-keys-too-short": ("sk-" + "a" * 15 + " ") * (MIB // 19),
    "non-ascii-header-names": "ı token é " * (MIB // 10),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_mebibyte_strings_redact_in_linear_time(name: str) -> None:
    filler = ADVERSARIAL[name]
    start = time.perf_counter()
    out = scrub_text(filler + TAIL)
    elapsed = time.perf_counter() - start
    assert out == filler + REDACTED_TAIL
    # A safety bound against quadratic patterns (minutes here), not a benchmark: 70-300 ms on 2026-11-25.
    assert elapsed < 2.0, f"{name}: {elapsed:.2f} s"


_PATTERNS = {replacement: pattern for pattern, replacement in _SUBSTITUTIONS}
_PLAIN_EMAIL = re.compile(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}")
_PLAIN_JWT = re.compile(r"\beyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]*")
_PIECES = ["a", "bc", "1", "@", ".", "-", "_", "%", "+", " ", "é", "eyJ", "eyJhbGci", "abcde", "com", "x.y",
           "-eyJ", "\n"]


@given(st.lists(st.sampled_from(_PIECES) | st.text(max_size=3), max_size=30).map("".join))
@settings(max_examples=600, deadline=None)
def test_linear_email_and_jwt_patterns_match_what_the_plain_ones_match(text: str) -> None:
    email = _PATTERNS["[REDACTED:email]"]
    assert email.sub("[REDACTED:email]", text) == _PLAIN_EMAIL.sub("[REDACTED:email]", text)
    jwt = _PATTERNS[r"\g<pre>[REDACTED:jwt]"]
    assert jwt.sub(r"\g<pre>[REDACTED:jwt]", text) == _PLAIN_JWT.sub("[REDACTED:jwt]", text)


_LINE_PIECES = ["    return x", "line 0001 of it", "line 0002 of it", "[REDACTED:content]", "TED:cont",
                "short",
                "a]b[c long", "é ü 😀 quote ' "]
_LINES = st.lists(st.sampled_from(_LINE_PIECES) | st.text(max_size=14), min_size=1, max_size=40)


@given(st.lists(_LINES.map("\n".join), min_size=1, max_size=4),
       st.lists(st.sampled_from(["    return x", "line 0001 of it", "[", "]", "\n", " ", "ED:content]",
                                 "\\n", "line 000"]) | st.text(max_size=10), max_size=20).map("".join))
@settings(max_examples=400, deadline=None)
def test_the_index_of_many_forms_scrubs_as_looking_for_each_form_does(values: list[str], noise: str) -> None:
    """``SensitiveSet`` looks only for forms whose indexed characters occur; the result must equal
    looking for every form of every value in turn, replacements included."""
    marked = SensitiveSet(sensitive(v) for v in values)
    for text in (noise, noise.join(values), "".join(values) + noise, repr(values[0]) + noise):
        assert marked.scrub(text) == scrub_sensitive(text, tuple(values))


def test_a_long_multiline_prompt_scrubs_in_time_linear_in_the_string() -> None:
    lines = [f"line {i:06d} of a long prompt" for i in range(40_000)]  # 1.1 MiB, 40k forms
    marked = SensitiveSet([sensitive("\n".join(lines))])
    text = ("unrelated words " * (MIB // 16)) + lines[123] + " end"
    start = time.perf_counter()
    out = marked.scrub(text)
    elapsed = time.perf_counter() - start
    assert out.endswith(" [REDACTED:content] end") and lines[123] not in out
    # Looking for each of 40k forms in 1 MiB took seconds; one pass over the string takes ~0.1 s.
    assert elapsed < 2.0, f"{elapsed:.2f} s"


def test_a_log_value_over_the_limit_is_summarized_without_being_scanned() -> None:
    redactor = Redactor(hash_key=b"k" * 32, max_value_chars=1000)
    huge = "x" * 600 + " alice@example.com " + "y" * 600
    out = redactor(None, "error", {"event": "failed", "error": huge, "reason": huge[:900]})
    assert out["error"] == {**redactor.summarize(huge), "is_over_limit": True}
    assert out["reason"] == "x" * 600 + " [REDACTED:email] " + "y" * 281  # under the limit: scrubbed


async def test_a_large_audit_event_is_scrubbed_off_the_event_loop(store: AuditStore, monkeypatch) -> None:
    from audit import patterns
    from audit.sink import store_txn_sink
    from gateway.audit_hook import AuditHook

    threads: list[int] = []
    real = patterns._is_clean

    def watched(text: str) -> bool:  # every scrubbed string passes here, on whatever thread scrubs it
        threads.append(threading.get_ident())
        return real(text)

    monkeypatch.setattr(patterns, "_is_clean", watched)
    big = {"allowed_models": [f"model-{i:05d}-{'m' * 64}" for i in range(2000)], "note": "my own prompt"}
    register_sensitive("my own prompt")  # the worker thread sees the task's registered content
    await store.append(make_event(ADMIN_ACTION, action="policy.update", after=big))
    clear_request_context()
    assert threads and threading.get_ident() not in threads
    async with store.engine.connect() as conn:
        stored = (await conn.execute(select(audit_events.c.data))).scalar_one()
    assert "my own prompt" not in stored and "[REDACTED:content]" in stored
    threads.clear()
    await store.append(make_event(ADMIN_ACTION, action="policy.update", after={"allowed_models": ["m"]}))
    assert threads and set(threads) == {threading.get_ident()}  # a small one costs less than a hand-off

    async def run(step, **_: object) -> None:  # the step runs on the event loop, as inline SQLite runs it
        async with store.engine.begin() as conn:
            await conn.run_sync(step)

    hook = AuditHook()
    hook.set_txn_sink(store_txn_sink(store), run)
    threads.clear()
    await hook.emit("admin.policy_updated", action="policy.update", after=big)
    assert threads and threading.get_ident() not in threads
    assert (await store.head()).seq == 3
