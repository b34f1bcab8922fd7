"""Audit event names, their allowed fields, and the ``AuditEvent`` the store appends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from audit.context import get_request_context

# Names match the gateway hook (gateway/audit_hook.py).
AUTH_SUCCEEDED = "auth.success"
AUTH_FAILED = "auth.failure"
REQUEST_ADMITTED = "request.admitted"
REQUEST_REJECTED = "request.rejected"
REQUEST_FINISHED = "request.finished"
ADMIN_ACTION = "admin.action"
POLICY_VERSION_CREATED = "policy.version_created"
KEY_CREATED = "key.created"
KEY_ROTATED = "key.rotated"
KEY_REVOKED = "key.revoked"
KEY_EXPIRED = "key.expired"
ADMIN_TOKEN_CREATED = "admin_token.created"
ADMIN_TOKEN_REVOKED = "admin_token.revoked"
AUDIT_EXPORTED = "audit.exported"
AUDIT_PURGED = "audit.purged"
RETENTION_RECORD_READ = "retention.record_read"
RETENTION_KEY_SHREDDED = "retention.key_shredded"
RETENTION_PURGED = "retention.purged"
SERVICE_STARTED = "service.started"
SERVICE_STOPPED = "service.stopped"

_REQUEST_COMMON = ("model", "num_prompt_tokens", "prompt_hash", "determinism", "policy_version")
# request.finished's determinism receipt: what ``kvgate replay`` needs besides the prompt and the structured
# output's spec, which the caller gives again. Its parameters are the engine's SamplingParams fields by
# name (gateway/inference/receipts.py walks them; a test holds this list to that walk), never content: a
# structured output is its kind and keyed hash.
RECEIPT_FIELDS = frozenset({
    "receipt_version", "kind", "model", "determinism", "system_fingerprint", "prompt_hash", "arrival_step",
    "token_hashes", "structured_kind", "structured_hash", "max_tool_calls",
    "num_choices", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "skip_special_tokens", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "include_stop_str_in_output", "allowed_token_ids",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "bad_words_token_ids",
})
# name -> fields allowed in ``data``. Top-level ids (tenant, key, request, actor) are columns, not data.
EVENT_FIELDS: dict[str, frozenset[str]] = {
    AUTH_SUCCEEDED: frozenset({"kind", "method", "path", "scopes"}),
    AUTH_FAILED: frozenset({"kind", "method", "path", "reason", "peer", "num_failures"}),
    # features: the names of the structured-output and tool features used and of the chat template fields
    # set, never a schema, arguments or values.
    # metadata, user, safety_identifier, service_tier, client_request_id: what the caller said of the
    # request, as sent; api and previous_response_id: a Responses API request, and the stored response
    # it continues.
    REQUEST_ADMITTED: frozenset({*_REQUEST_COMMON, "max_tokens", "priority", "num_reserved_tokens",
                                 "features", "metadata", "user", "safety_identifier", "service_tier",
                                 "client_request_id", "api", "previous_response_id"}),
    REQUEST_REJECTED: frozenset({*_REQUEST_COMMON, "reason", "code", "status", "violations", "status_code"}),
    REQUEST_FINISHED: frozenset({
        *_REQUEST_COMMON, "num_completion_tokens", "num_cached_tokens", "latency_ms", "ttft_ms",
        "finish_reason", "finish_reasons", "status_code", "is_stream", "is_aborted", *RECEIPT_FIELDS,
    }),
    ADMIN_ACTION: frozenset({"action", "target_type", "target_id", "before", "after", "status_code"}),
    POLICY_VERSION_CREATED: frozenset({"version", "previous_version", "before", "after", "comment"}),
    KEY_CREATED: frozenset({"name", "expires_at", "scopes"}),
    KEY_ROTATED: frozenset({"rotated_to", "expires_at"}),
    KEY_REVOKED: frozenset({"reason"}),
    KEY_EXPIRED: frozenset({"expired_at"}),
    ADMIN_TOKEN_CREATED: frozenset({"admin_id", "name"}),
    ADMIN_TOKEN_REVOKED: frozenset({"admin_id", "reason"}),
    AUDIT_EXPORTED: frozenset({"since", "until", "tenant", "format", "num_events", "first_seq", "last_seq",
                               "manifest_sha256"}),
    # cut_hash: the public chain link at cut_seq, where the retained chain starts.
    AUDIT_PURGED: frozenset({"before", "cut_seq", "cut_hash", "num_deleted"}),
    RETENTION_RECORD_READ: frozenset({"record_id", "reason"}),
    RETENTION_KEY_SHREDDED: frozenset({"num_records"}),
    RETENTION_PURGED: frozenset({"num_deleted"}),
    SERVICE_STARTED: frozenset({"version", "pid"}),
    SERVICE_STOPPED: frozenset({"pid"}),
}

# Any ``admin.<action>`` name (the gateway emits admin.tenant_created, admin.key_rotated, ...).
ADMIN_PREFIX = "admin."
ADMIN_FIELDS = frozenset({"action", "target_type", "target_id", "before", "after", "version", "new_key_id",
                          "name", "expires_at", "status_code", "comment"})

# Keys dropped from admin before/after snapshots at any depth: the audit trail never holds secrets.
SECRET_FIELD_NAMES = frozenset({
    "secret", "secret_hash", "token", "token_hash", "api_key", "key", "password", "pepper", "private_key",
    "wrapped_key", "data_key", "master_key", "authorization",
})


_SCALARS = frozenset({str, int, float, bool, type(None)})


def strip_secrets(value: Any) -> Any:
    """A copy of ``value`` without secret-named keys (for admin before/after snapshots)."""
    if type(value) in _SCALARS:  # most fields: no ABC check
        return value
    if isinstance(value, Mapping):
        return {str(k): strip_secrets(v) for k, v in value.items()
                if str(k).lower() not in SECRET_FIELD_NAMES}
    if isinstance(value, list | tuple):
        return [strip_secrets(v) for v in value]
    return value


def records_purge(record: Mapping[str, Any], cut_seq: int, cut_hash: str) -> bool:
    """Whether a stored or exported ``record`` is the ``audit.purged`` event of a cut at ``cut_seq``
    whose link is ``cut_hash`` (it follows the cut: the purge appended it after deleting). An event of a
    purge made before purges recorded the link names the cut by its sequence alone; it is chained after
    the cut like any event, so it still proves that the rows before the cut were purged, not lost."""
    data, seq = record.get("data"), record.get("seq")
    return (record.get("name") == AUDIT_PURGED and isinstance(data, dict) and isinstance(seq, int)
            and seq > cut_seq and data.get("cut_seq") == cut_seq
            and data.get("cut_hash", cut_hash) == cut_hash)


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One event before it is chained. ``data`` holds only the fields ``EVENT_FIELDS`` allows."""

    name: str
    data: dict[str, Any] = field(default_factory=dict)
    tenant_id: str | None = None
    key_id: str | None = None
    request_id: str | None = None
    actor: str | None = None
    is_redacted: bool = False  # ``data`` is already as the store keeps it (``audit.scrubbing``)

    def __repr__(self) -> str:  # ids only; data may be large
        return f"AuditEvent(name={self.name!r}, tenant_id={self.tenant_id!r}, fields={sorted(self.data)})"


def make_event(
    name: str,
    *,
    tenant_id: str | None = None,
    key_id: str | None = None,
    request_id: str | None = None,
    actor: str | None = None,
    **fields: Any,
) -> AuditEvent:
    """Build a validated event; ids default to the bound request context.

    Raises:
        ValueError: Unknown event name or a field outside its allow-list.
    """
    allowed = EVENT_FIELDS.get(name) or (ADMIN_FIELDS if name.startswith(ADMIN_PREFIX) else None)
    if allowed is None:
        raise ValueError(f"unknown audit event {name!r}")
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"fields not allowed in {name}: {sorted(unknown)}")
    ctx = get_request_context()
    data = {k: strip_secrets(v) for k, v in fields.items() if v is not None}
    return AuditEvent(
        name=name, data=data, tenant_id=tenant_id or ctx["tenant_id"], key_id=key_id or ctx["key_id"],
        request_id=request_id or ctx["request_id"], actor=actor,
    )
