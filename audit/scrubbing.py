"""An audit event's data as the store keeps it: scrubbed, on a worker thread when the event is large."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson

from audit.context import get_sensitive
from audit.events import AuditEvent
from audit.patterns import is_digest_field, scrub_text

# Events holding more text than this are scrubbed on a worker thread by the async append paths. The
# gateway's own events hold ids, counts and short strings; an admin change's before/after snapshot of a
# policy can hold up to a request body's worth.
OFF_LOOP_CHARS = 1 << 16


def redact_event(event: AuditEvent) -> AuditEvent:
    """``event`` with its data JSON-normalised and every string scrubbed of secrets and of the request's
    registered content. The ids stay as they are: they are the gateway's own, never secrets."""
    if event.is_redacted:
        return event
    # Round-trip through JSON so the hashed form equals what a reader will parse back.
    data = orjson.loads(orjson.dumps(event.data, default=str,
                                     option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SORT_KEYS))
    return dataclasses.replace(event, data=_scrub_data(data, get_sensitive()), is_redacted=True)


async def redact_off_loop(event: AuditEvent) -> AuditEvent:
    """``redact_event`` on a worker thread when the event holds more than ``OFF_LOOP_CHARS`` characters
    of text, so that a large one cannot hold the event loop; otherwise ``event`` unchanged (the store
    scrubs it when it chains it). The thread sees this task's registered content (``to_thread`` copies
    the context)."""
    if event.is_redacted or _num_chars(event.data, OFF_LOOP_CHARS) <= OFF_LOOP_CHARS:
        return event
    return await asyncio.to_thread(redact_event, event)


def _num_chars(value: Any, limit: int) -> int:
    """Characters of text in ``value`` (keys included), counted up to just past ``limit``."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        parts: Any = [*value, *value.values()]
    elif isinstance(value, list | tuple):
        parts = value
    else:
        return 0
    total = 0
    for part in parts:
        total += _num_chars(part, limit - total)
        if total > limit:
            break
    return total


def _scrub_data(value: Any, sensitive: tuple[str, ...], key: str = "") -> Any:
    if isinstance(value, str):
        return value if is_digest_field(key, value) else scrub_text(value, sensitive)
    if isinstance(value, dict):
        return {k: _scrub_data(v, sensitive, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub_data(v, sensitive, key) for v in value]
    return value
