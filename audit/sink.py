"""Adapter from the gateway's ``AuditHook`` sink signature ``(name, fields)`` to ``AuditStore.append``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from audit.events import make_event
from audit.store import AuditStore

_ID_FIELDS = ("tenant_id", "key_id", "request_id", "actor")


def store_sink(store: AuditStore) -> Callable[[str, Mapping[str, Any]], Awaitable[None]]:
    """A sink that chains every event into ``store``.

    Raises (from the returned coroutine):
        AuditUnavailable: The store is down; the request must fail closed (503).
        ValueError: Unknown event name or field (a programming error; never swallow it).
    """

    async def sink(name: str, fields: Mapping[str, Any]) -> None:
        data = dict(fields)
        ids = {k: (str(data.pop(k)) if data.get(k) is not None else data.pop(k, None)) for k in _ID_FIELDS}
        await store.append(make_event(name, **ids, **data))

    return sink
