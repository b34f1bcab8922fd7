"""Allow-list redaction processor for structlog: hashes content fields, scrubs secrets everywhere."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from audit.context import get_sensitive
from audit.events import RECEIPT_FIELDS
from audit.patterns import REDACTED, is_card_number, is_digest_field, scrub_text

# Keys whose values are user content: never logged, replaced by {"len", "hmac"}.
CONTENT_KEYS = frozenset({
    "prompt", "prompts", "completion", "completions", "messages", "message_content", "content", "text",
    "input", "inputs", "output", "outputs", "body", "request_body", "response_body", "choices", "delta",
    "suffix", "system", "instructions", "tool_calls", "arguments",
})
# Keys whose values are credentials whatever they look like.
SECRET_KEYS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api_key", "apikey", "x-admin-token", "cookie",
    "set-cookie", "password", "passwd", "secret", "secret_hash", "token", "token_hash", "access_token",
    "refresh_token", "client_secret", "private_key", "pepper", "chain_key", "data_key", "wrapped_key",
    "master_key", "key_material", "raw_key",
})
# Top-level keys allowed through (values still scrubbed); everything else is masked.
DEFAULT_ALLOWED_KEYS = frozenset({
    "event", "level", "timestamp", "logger", "logger_name", "exception", "stack", "stack_info",
    "request_id", "tenant_id", "key_id", "admin_id", "actor", "model", "method", "path", "route", "status",
    "status_code", "http_version", "client", "reason", "error", "error_type", "finish_reason",
    "determinism", "policy_version", "seq", "count", "duration_ms", "latency_ms", "ttft_ms", "prompt_hash",
    "action", "target", "target_id", "scopes", "version", "host", "port", "pid", "device", "dtype",
    "num_blocks", "attempt", "url", "db", "revision", "headers", "event_name",
    # request.finished's determinism receipt:
    *RECEIPT_FIELDS,
    # request.admitted's feature names (json_schema, tools, ...): fixed words, never the schema itself.
    "features",
})
ALLOWED_PREFIXES = ("num_", "is_", "max_", "min_")
ALLOWED_SUFFIXES = ("_ms", "_s", "_bytes", "_count", "_id", "_ids", "_seq")
NOT_ALLOWED = "[not-allowlisted]"
# Longest string value a log line carries; a longer one is written as its length and keyed hash, never
# scanned: the redactor runs on the event loop, and a value of megabytes would hold it for a while.
DEFAULT_MAX_VALUE_CHARS = 65_536
# The gateway's own ids: a request's content that happens to equal one (a prompt that is its tenant id)
# must not erase it from every line of that request, so registered content is not scrubbed from them.
ID_KEYS = frozenset({"request_id", "tenant_id", "key_id", "actor"})


def keyed_hash(value: str | bytes, key: bytes) -> str:
    """HMAC-SHA256 of ``value``, hex (128 bits): correlates equal prompts without revealing them."""
    data = value.encode() if isinstance(value, str) else value
    return hmac.new(key, data, hashlib.sha256).hexdigest()[:32]


class Redactor:
    """A pure structlog processor: allow-lists keys, hashes content, scrubs secrets in every string.

    Place it second to last, just before the renderer, so it sees merged contextvars and formatted
    exceptions. It keeps no state besides its configuration, so one instance may serve many chains.
    """

    def __init__(self, hash_key: bytes | None = None, extra_allowed: Iterable[str] = (),
                 max_value_chars: int = DEFAULT_MAX_VALUE_CHARS) -> None:
        # A per-process random key still hides content; pass a stable key to correlate across restarts.
        self._hash_key = hash_key or secrets.token_bytes(32)
        self._allowed = DEFAULT_ALLOWED_KEYS | frozenset(extra_allowed)
        self._max_value_chars = max_value_chars

    def __call__(self, logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        sensitive = get_sensitive()
        out: dict[str, Any] = {}
        for key, value in event_dict.items():
            if key in CONTENT_KEYS:
                out[key] = self.summarize(value)
            elif _is_secret_key(key):
                out[key] = REDACTED
            elif key in ID_KEYS and isinstance(value, str):
                out[key] = self._scrub_text(value, ())
            elif self.is_allowed(key):
                out[key] = value if is_digest_field(key, value) else self.scrub(value, sensitive)
            else:
                out[key] = NOT_ALLOWED
        return out

    def is_allowed(self, key: str) -> bool:
        return key in self._allowed or key.startswith(ALLOWED_PREFIXES) or key.endswith(ALLOWED_SUFFIXES)

    def summarize(self, value: Any) -> dict[str, Any]:
        """``{"len": n, "hmac": h}`` for a content value (strings as is, anything else as JSON)."""
        if isinstance(value, str):
            text = value
        elif isinstance(value, bytes):
            text = value.decode("utf-8", "replace")
        else:
            text = orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS).decode()
        return {"len": len(text), "hmac": keyed_hash(text, self._hash_key)}

    def scrub(self, value: Any, sensitive: tuple[str, ...] = ()) -> Any:
        """Recursively scrub strings; nested content/secret keys are hashed/masked too."""
        if isinstance(value, str):
            return self._scrub_text(value, sensitive)
        if isinstance(value, bool) or value is None or isinstance(value, float):
            return value
        if isinstance(value, int):
            return "[REDACTED:card]" if is_card_number(value) else value
        if isinstance(value, bytes):
            return self._scrub_text(value.decode("utf-8", "replace"), sensitive)
        if isinstance(value, Mapping):
            return {str(k): self._scrub_item(str(k), v, sensitive) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.scrub(v, sensitive) for v in value]
        # Arbitrary objects (exceptions, ORM rows): their repr may hold anything, so scrub the text.
        return self._scrub_text(repr(value), sensitive)

    def _scrub_text(self, text: str, sensitive: tuple[str, ...]) -> str | dict[str, Any]:
        if len(text) > self._max_value_chars:
            return {**self.summarize(text), "is_over_limit": True}
        return scrub_text(text, sensitive)

    def _scrub_item(self, key: str, value: Any, sensitive: tuple[str, ...]) -> Any:
        if key.lower() in CONTENT_KEYS:
            return self.summarize(value)
        if _is_secret_key(key):
            return REDACTED
        return self.scrub(value, sensitive)


def _is_secret_key(key: str) -> bool:
    return key.lower() in SECRET_KEYS
