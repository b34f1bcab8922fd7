"""Adapters from the gateway's ``AuditHook`` sink signature ``(name, fields)`` to ``AuditStore``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sqlalchemy import Connection

from audit.events import AuditEvent, make_event
from audit.store import AuditStore

_ID_FIELDS = ("tenant_id", "key_id", "request_id", "actor")


def _to_event(name: str, fields: Mapping[str, Any]) -> AuditEvent:
    data = dict(fields)
    ids = {k: (str(data.pop(k)) if data.get(k) is not None else data.pop(k, None)) for k in _ID_FIELDS}
    return make_event(name, **ids, **data)


def store_sink(store: AuditStore) -> Callable[[str, Mapping[str, Any]], Awaitable[None]]:
    """A sink that chains every event into ``store``.

    Raises (from the returned coroutine):
        AuditUnavailable: The store is down; the request must fail closed (503).
        ValueError: Unknown event name or field (a programming error; never swallow it).
    """

    async def sink(name: str, fields: Mapping[str, Any]) -> None:
        await store.append(_to_event(name, fields))

    return sink


def store_txn_sink(store: AuditStore) -> Callable[[str, Mapping[str, Any]], Callable[[Connection], None]]:
    """Like ``store_sink``, but each event becomes a step that appends it inside the caller's synchronous
    transaction on the store's database, so it commits or rolls back together with the caller's writes.

    The event is built (and its fields checked) when the step is made, in the caller's context; the step
    raises whatever the database raises.
    """

    def prepare(name: str, fields: Mapping[str, Any]) -> Callable[[Connection], None]:
        event = _to_event(name, fields)

        def step(conn: Connection) -> None:
            store.append_sync(conn, event)

        return step

    return prepare
