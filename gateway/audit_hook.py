"""The one place the request path reports auditable events; the audit package plugs its writer in here.

Events (``name`` → fields; never prompts, completions or secrets):
    auth.success / auth.failure     key_id, tenant_id, kind, reason, path
    request.admitted                request_id, tenant_id, key_id, model, num_prompt_tokens,
                                    num_reserved_tokens, max_tokens, priority, determinism
    request.rejected                request_id, tenant_id, key_id, code, status
    request.finished                request_id, tenant_id, key_id, finish_reason, num_prompt_tokens,
                                    num_completion_tokens, num_cached_tokens, is_aborted
    admin.<action>                  actor (admin token id or "cli"), tenant_id, key_id, version, ...
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

AuditSink = Callable[[str, Mapping[str, Any]], Awaitable[None] | None]

log = structlog.get_logger("kvgate.audit")


def log_sink(name: str, fields: Mapping[str, Any]) -> None:
    """Default sink: one structured log line per event."""
    log.info(name, **fields)


class AuditUnavailableError(Exception):
    """The audit trail could not record an event; the gateway answers 503 rather than act unaudited."""


class AuditHook:
    """Calls the configured sink. Fails closed: a sink error raises ``AuditUnavailableError``, except for
    events emitted with ``required=False`` (after the work is done, e.g. ``request.finished``), which are
    logged instead because there is nothing left to refuse."""

    def __init__(self, sink: AuditSink | None = None) -> None:
        self._sink = sink or log_sink

    def set_sink(self, sink: AuditSink) -> None:
        self._sink = sink

    async def emit(self, name: str, *, required: bool = True, **fields: Any) -> None:
        try:
            result = self._sink(name, fields)
            if inspect.isawaitable(result):
                await result
        except Exception as e:
            log.error("audit.sink_failed", event_name=name, error_type=type(e).__name__)
            if required:
                raise AuditUnavailableError(name) from e
