"""Secret and personal-data patterns, and the string scrubber every audit output goes through.

Every pattern runs in time linear in the text (a 1 MiB string takes milliseconds, not minutes): a
pattern runs only when a literal it cannot match without is in the text (a ``str`` search at memchr
speed), and the two whose plain ``re.sub`` is quadratic on a long run of the characters they start
with (emails, JWTs) are written so that they try each run once.
"""

from __future__ import annotations

import re

from audit.sensitive import scrub_sensitive

# kvgate tokens are ``<prefix>_<key id>_<secret>`` (gateway/secrets.py: 16 hex id, url-safe secret).
# The scrubbers are deliberately looser than the parser so malformed or truncated tokens are caught too.
KVG_KEY_RE = re.compile(r"kvg_([0-9A-Za-z]{1,64})_[A-Za-z0-9_\-]{4,}")
ADMIN_TOKEN_RE = re.compile(r"kvga_([0-9A-Za-z]{1,64})_[A-Za-z0-9_\-]{4,}")
# Strict forms, for the gateway's parsers and for tests.
KVG_KEY_FORMAT = re.compile(r"^kvg_[0-9a-f]{16}_[A-Za-z0-9_-]{20,128}$")
ADMIN_TOKEN_FORMAT = re.compile(r"^kvga_[0-9a-f]{16}_[A-Za-z0-9_-]{20,128}$")

REDACTED = "[REDACTED]"


class EmailPattern:
    """The email pattern, ``[local chars]+@domain``, without ``re.sub``'s quadratic retries.

    ``re.sub`` tries the local part at every position of a long run of local characters ('a' * 1 MiB:
    minutes) and rescans the rest of the run each time. Here the search looks for an ``@`` with a valid
    domain after it (each ``@`` tried once), then takes the run of local characters just before it
    (scanned once, backwards, on the reversed text). Matches are exactly those ``re.sub`` finds.
    """

    _domain = re.compile(r"@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}")
    _local = re.compile(r"[A-Za-z0-9._%+\-]*")

    def sub(self, repl: str, text: str) -> str:
        parts, done, pos, reverse = [], 0, 0, ""
        while (domain := self._domain.search(text, pos)) is not None:
            at = domain.start()
            reverse = reverse or text[::-1]
            # In the reversed text the local part starts at len - at and may not reach into the last match.
            back = self._local.match(reverse, len(text) - at, len(text) - done)
            start = at - (back.end() - back.start())  # type: ignore[union-attr]
            if start == at:  # nothing before the "@": no match here
                pos = at + 1
                continue
            parts += (text[done:start], repl)
            done = pos = domain.end()
        return "".join(parts) + text[done:] if parts else text


_JWT = r"A-Za-z0-9_\-"
_HEADER_NAMES = (
    r"authorization|proxy-authorization|x-api-key|api[-_]?key|x-admin-token|cookie|set-cookie"
    r"|password|passwd|secret|client[-_]secret|access[-_]token|refresh[-_]token|token"
)
_Pattern = re.Pattern[str] | EmailPattern
_SUBSTITUTIONS: tuple[tuple[_Pattern, str], ...] = (
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(-----END [A-Z0-9 ]*PRIVATE KEY-----|$)", re.S),
     "[REDACTED:private-key]"),
    (ADMIN_TOKEN_RE, r"kvga_\1_" + REDACTED),
    (KVG_KEY_RE, r"kvg_\1_" + REDACTED),
    # Header / key=value forms: keep the name, drop the value up to a quote, comma, brace or line end.
    (re.compile(rf"(?i)\b({_HEADER_NAMES})\b([\"']?\s*[:=]\s*[\"']?)[^\"'\r\n,}}&]+"), r"\1\2" + REDACTED),
    (re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=\-]{6,}"), r"\1 " + REDACTED),
    # ``\beyJ...``, tried once per run of token characters, at its first ``eyJ`` on a word boundary:
    # a later start in the same run reaches the same run end with less before it, so it fails too.
    # (Tried at every ``\beyJ``, 'eyJ-' * 256k took minutes.)
    (re.compile(rf"(?<![{_JWT}])(?>(?P<pre>[{_JWT}]*?)(?<!\w)(?=eyJ))eyJ[{_JWT}]{{5,}}\.[{_JWT}]{{5,}}"
                rf"\.[{_JWT}]*"), r"\g<pre>[REDACTED:jwt]"),
    (re.compile(r"\bsk-(?:ant-|proj-|live-|test-)?[A-Za-z0-9_\-]{16,}"), "[REDACTED:api-key]"),
    (re.compile(r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"), "[REDACTED:api-key]"),
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}\b"), "[REDACTED:aws-key]"),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), "[REDACTED:github-token]"),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), "[REDACTED:github-token]"),
    (re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"), "[REDACTED:gitlab-token]"),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), "[REDACTED:slack-token]"),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"), "[REDACTED:google-key]"),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}"), "[REDACTED:hf-token]"),
    (EmailPattern(), "[REDACTED:email]"),
)
# For each substitution, literals of which every match holds one; lower case for the case-insensitive
# two, which are looked for in the lower-cased text when it is ASCII (Unicode case folding lets 'K',
# the Kelvin sign, match 'k', so other text always gets those two).
_NEEDLES: tuple[tuple[str, ...], ...] = (
    ("PRIVATE KEY-----",), ("kvga_",), ("kvg_",),
    ("authorization", "api", "cookie", "passw", "secret", "token"), ("bearer", "basic", "token"),
    ("eyJ",), ("sk-",), ("k_live_", "k_test_"), ("AKIA", "ASIA", "AGPA", "AIDA", "AROA"),
    ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"), ("github_pat_",), ("glpat-",), ("xox",), ("AIza",), ("hf_",),
    ("@",),
)
_FOLDED = (3, 4)  # the case-insensitive substitutions
_ANY_NEEDLE = re.compile("|".join(re.escape(n) for i, ns in enumerate(_NEEDLES) if i not in _FOLDED
                                  for n in ns))
_ANY_FOLDED_NEEDLE = re.compile("|".join(n for i in _FOLDED for n in _NEEDLES[i]))
_ANY_FOLDED_NEEDLE_I = re.compile(_ANY_FOLDED_NEEDLE.pattern, re.I)
# 13-19 digits (any script's: fullwidth too) in groups split by up to three spaces, no-break spaces,
# hyphens or dashes ("4111 - 1111 ..."), not inside a word (a hex id may carry a Luhn-valid run). Dots
# and slashes are not separators: an epoch time with decimals would be a Luhn-valid run one time in ten.
_CARD_RE = re.compile(r"(?<![\dA-Za-z])(?:\d[ \-\u00a0\u2010-\u2015]{0,3}){12,18}\d(?![\dA-Za-z])")
_DOUBLED = (0, 2, 4, 6, 8, 1, 3, 5, 7, 9)  # a Luhn digit doubled, digit-summed
_CARD_SEPARATORS = dict.fromkeys(map(ord, " -\u00a0\u2010\u2011\u2012\u2013\u2014\u2015"))


def is_luhn_valid(digits: str) -> bool:
    total = sum(map(int, digits[-1::-2])) + sum(_DOUBLED[int(d)] for d in digits[-2::-2])
    return total % 10 == 0


def _card_sub(match: re.Match[str]) -> str:
    digits = match.group(0).translate(_CARD_SEPARATORS)
    if not digits.isascii():  # fullwidth and other scripts' digits
        digits = "".join(str(int(ch)) for ch in digits)
    if 13 <= len(digits) <= 19 and is_luhn_valid(digits):
        return "[REDACTED:card]"
    return match.group(0)


def _may_match(i: int, text: str) -> bool:
    """Whether substitution ``i`` can change ``text``: one of its needles is in it."""
    if i in _FOLDED:
        if not text.isascii():
            return True
        text = text.lower()
    return any(n in text for n in _NEEDLES[i])


def _may_hold_secret(text: str) -> bool:
    """False only when no substitution can change ``text`` (no needle, no card-shaped digit run)."""
    if _ANY_NEEDLE.search(text) or _CARD_RE.search(text):
        return True
    if text.isascii():
        return _ANY_FOLDED_NEEDLE.search(text.lower()) is not None
    return _ANY_FOLDED_NEEDLE_I.search(text) is not None


# Short strings found free of any secret form (ids, model names, modes: an audit event's fields repeat
# across events and requests). Only clean strings are kept, never one a pattern could change.
_CLEAN: dict[str, None] = {}
_CLEAN_MAX_CHARS, _CLEAN_MAX_ENTRIES = 128, 4096


def _is_clean(text: str) -> bool:
    if text in _CLEAN:
        return True
    if _may_hold_secret(text):
        return False
    if len(text) <= _CLEAN_MAX_CHARS:
        if len(_CLEAN) >= _CLEAN_MAX_ENTRIES:
            _CLEAN.clear()
        _CLEAN[text] = None
    return True


def scrub_text(text: str, sensitive: tuple[str, ...] = ()) -> str:
    """Remove every known secret form, and each ``sensitive`` value (plus its repr/JSON escapes)."""
    if sensitive:
        text = scrub_sensitive(text, sensitive)
    if _is_clean(text):
        return text
    for i, (pattern, replacement) in enumerate(_SUBSTITUTIONS):
        if _may_match(i, text):
            text = pattern.sub(replacement, text)
    return _CARD_RE.sub(_card_sub, text)


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

