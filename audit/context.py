"""Request-scoped context (request, tenant and key ids) shared by logs and audit events."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import structlog

from audit.sensitive import SensitiveSet, sensitive

CONTEXT_KEYS = ("request_id", "tenant_id", "key_id")

# Values that must never reach a log line even as substrings (the current request's prompt, say).
# Kept apart from structlog's contextvars so they are never merged into an event.
_sensitive: ContextVar[tuple[str, ...]] = ContextVar("kvgate_sensitive", default=())


def bind_request_context(
    *, request_id: str | None = None, tenant_id: str | None = None, key_id: str | None = None
) -> None:
    """Bind ids (never secrets) for every log line and audit event of this task."""
    values = {"request_id": request_id, "tenant_id": tenant_id, "key_id": key_id}
    structlog.contextvars.bind_contextvars(**{k: v for k, v in values.items() if v is not None})


def clear_request_context() -> None:
    structlog.contextvars.unbind_contextvars(*CONTEXT_KEYS)
    _sensitive.set(())


def get_request_context() -> dict[str, str | None]:
    bound = structlog.contextvars.get_contextvars()
    return {key: bound.get(key) for key in CONTEXT_KEYS}


def register_sensitive(*values: str) -> None:
    """Mark strings (prompts, completions) that the redactor must scrub wherever they appear."""
    extra = tuple(sensitive(v) for v in values if isinstance(v, str) and v)
    if extra:
        _sensitive.set(SensitiveSet(_sensitive.get() + extra))


def get_sensitive() -> tuple[str, ...]:
    return _sensitive.get()


@contextmanager
def request_context(
    *, request_id: str | None = None, tenant_id: str | None = None, key_id: str | None = None
) -> Iterator[None]:
    """Bind for the duration of a block; restores the previous values afterwards."""
    with structlog.contextvars.bound_contextvars(
        **{k: v for k, v in {"request_id": request_id, "tenant_id": tenant_id, "key_id": key_id}.items()
           if v is not None}
    ):
        token = _sensitive.set(_sensitive.get())
        try:
            yield
        finally:
            _sensitive.reset(token)
