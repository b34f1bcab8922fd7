"""Secret and personal-data patterns, and the string scrubber every audit output goes through."""

from __future__ import annotations

import re

# kvgate tokens are ``<prefix>_<key id>_<secret>`` (gateway/secrets.py: 16 hex id, url-safe secret).
# The scrubbers are deliberately looser than the parser so malformed or truncated tokens are caught too.
KVG_KEY_RE = re.compile(r"kvg_([0-9A-Za-z]{1,64})_[A-Za-z0-9_\-]{4,}")
ADMIN_TOKEN_RE = re.compile(r"kvga_([0-9A-Za-z]{1,64})_[A-Za-z0-9_\-]{4,}")
# Strict forms, for the gateway's parsers and for tests.
KVG_KEY_FORMAT = re.compile(r"^kvg_[0-9a-f]{16}_[A-Za-z0-9_-]{20,128}$")
ADMIN_TOKEN_FORMAT = re.compile(r"^kvga_[0-9a-f]{16}_[A-Za-z0-9_-]{20,128}$")

REDACTED = "[REDACTED]"

_HEADER_NAMES = (
    r"authorization|proxy-authorization|x-api-key|api[-_]?key|x-admin-token|cookie|set-cookie"
    r"|password|passwd|secret|client[-_]secret|access[-_]token|refresh[-_]token|token"
)
_SUBSTITUTIONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(-----END [A-Z0-9 ]*PRIVATE KEY-----|$)", re.S),
     "[REDACTED:private-key]"),
    (ADMIN_TOKEN_RE, r"kvga_\1_" + REDACTED),
    (KVG_KEY_RE, r"kvg_\1_" + REDACTED),
    # Header / key=value forms: keep the name, drop the value up to a quote, comma, brace or line end.
    (re.compile(rf"(?i)\b({_HEADER_NAMES})\b([\"']?\s*[:=]\s*[\"']?)[^\"'\r\n,}}&]+"), r"\1\2" + REDACTED),
    (re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=\-]{6,}"), r"\1 " + REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]*"), "[REDACTED:jwt]"),
    (re.compile(r"\bsk-(?:ant-|proj-|live-|test-)?[A-Za-z0-9_\-]{16,}"), "[REDACTED:api-key]"),
    (re.compile(r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"), "[REDACTED:api-key]"),
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}\b"), "[REDACTED:aws-key]"),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), "[REDACTED:github-token]"),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), "[REDACTED:github-token]"),
    (re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"), "[REDACTED:gitlab-token]"),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), "[REDACTED:slack-token]"),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"), "[REDACTED:google-key]"),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}"), "[REDACTED:hf-token]"),
    (re.compile(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}"), "[REDACTED:email]"),
)
# 13-19 digits (any script's: fullwidth too) in groups split by up to three spaces, no-break spaces,
# hyphens or dashes ("4111 - 1111 ..."), not inside a word (a hex id may carry a Luhn-valid run). Dots
# and slashes are not separators: an epoch time with decimals would be a Luhn-valid run one time in ten.
_CARD_RE = re.compile(r"(?<![\dA-Za-z])(?:\d[ \-\u00a0\u2010-\u2015]{0,3}){12,18}\d(?![\dA-Za-z])")


def _scoped(pattern: re.Pattern[str]) -> str:
    """``pattern`` as a group that keeps its own flags inside a larger alternation."""
    source, flags = pattern.pattern, ""
    if source.startswith("(?i)"):
        source, flags = source[4:], "i"
    if pattern.flags & re.S:
        flags += "s"
    return f"(?{flags}:{source})" if flags else f"(?:{source})"


# Every pattern in one alternation: a search that finds nothing proves that no substitution would change
# the text, so the common case (an id, a number, a word) costs one scan instead of one per pattern.
_ANY_SECRET = re.compile("|".join(_scoped(p) for p, _ in (*_SUBSTITUTIONS, (_CARD_RE, ""))))


def is_luhn_valid(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_sub(match: re.Match[str]) -> str:
    digits = "".join(str(int(ch)) for ch in match.group(0) if ch.isdecimal())
    if 13 <= len(digits) <= 19 and is_luhn_valid(digits):
        return "[REDACTED:card]"
    return match.group(0)


class Sensitive(str):
    """A value to scrub (``sensitive``), with the forms it may show up in worked out once, when it is
    registered, rather than for every string it is scrubbed from (an audit event has a dozen)."""

    forms: tuple[str, ...]


def sensitive(value: str) -> Sensitive:
    marked = Sensitive(value)
    marked.forms = _forms(value)
    return marked


def _forms(value: str) -> tuple[str, ...]:
    """The value as it may show up: escaped (repr in a traceback, JSON in a body) or one line at a time;
    longest first, so a line inside the whole is not replaced before the whole."""
    forms = {value, repr(value)[1:-1], value.encode("unicode_escape").decode("ascii", "replace")}
    forms.update(line for line in value.splitlines() if len(line.strip()) >= 8)
    return tuple(sorted((f for f in forms if f), key=len, reverse=True))


# Short strings one scan found free of any secret form (ids, model names, modes: an audit event's fields
# repeat across events and requests). Only clean strings are kept, never one a pattern matched.
_CLEAN: dict[str, None] = {}
_CLEAN_MAX_CHARS, _CLEAN_MAX_ENTRIES = 128, 4096


def _is_clean(text: str) -> bool:
    if text in _CLEAN:
        return True
    if _ANY_SECRET.search(text):
        return False
    if len(text) <= _CLEAN_MAX_CHARS:
        if len(_CLEAN) >= _CLEAN_MAX_ENTRIES:
            _CLEAN.clear()
        _CLEAN[text] = None
    return True


def scrub_text(text: str, sensitive: tuple[str, ...] = ()) -> str:
    """Remove every known secret form, and each ``sensitive`` value (plus its repr/JSON escapes)."""
    for value in sensitive:
        text = _scrub_value(text, value)
    if _is_clean(text):
        return text
    for pattern, replacement in _SUBSTITUTIONS:
        text = pattern.sub(replacement, text)
    return _CARD_RE.sub(_card_sub, text)


def _scrub_value(text: str, value: str) -> str:
    if len(value) < 4:
        return text
    for form in value.forms if isinstance(value, Sensitive) else _forms(value):
        if form in text:
            text = text.replace(form, "[REDACTED:content]")
    return text


def is_card_number(value: int) -> bool:
    digits = str(abs(value))
    return 13 <= len(digits) <= 19 and is_luhn_valid(digits)


_DIGEST_RE = re.compile(r"(?:fp_)?[0-9a-f]{16,128}")
_DIGEST_SUFFIXES = ("_hash", "_hashes", "_sha256", "_fingerprint")


def is_digest_field(key: str, value: object) -> bool:
    """Whether ``value`` is a hex digest (or a list of them) under a digest-named key (``prompt_hash``,
    ``token_hashes``, ``system_fingerprint``). Such values skip scrubbing: a random digest can hold a
    Luhn-valid digit run or a short prompt's letters by chance, and scrubbing would corrupt a receipt.
    Only pure hex qualifies, so nothing else can hide under such a key."""
    if not key.endswith(_DIGEST_SUFFIXES):
        return False
    values = value if isinstance(value, list) else [value]
    return bool(values) and all(isinstance(v, str) and _DIGEST_RE.fullmatch(v) for v in values)
