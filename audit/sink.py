"""Adapters from the gateway's ``AuditHook`` sink signature ``(name, fields)`` to ``AuditStore``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sqlalchemy import Connection

from audit.events import AuditEvent, make_event
from audit.scrubbing import redact_off_loop
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


class AppendStep:
    """Events to append, in order, inside a caller's synchronous transaction on the store's database."""

    __slots__ = ("store", "events")

    def __init__(self, store: AuditStore, events: tuple[AuditEvent, ...]) -> None:
        self.store = store
        self.events = events

    def __call__(self, conn: Connection) -> None:
        self.store.append_many_sync(conn, self.events)

    async def redacted_off_loop(self) -> AppendStep:
        """This step with its large events already scrubbed, on a worker thread (``redact_off_loop``):
        the step itself may run on the event loop (inside the caller's transaction)."""
        events = tuple([await redact_off_loop(event) for event in self.events])
        return self if events == self.events else AppendStep(self.store, events)

    def then(self, other: object) -> AppendStep | None:
        """One step appending this step's events, then ``other``'s (one head lock and update for all);
        ``None`` when ``other`` appends elsewhere or is not an append."""
        if not isinstance(other, AppendStep) or other.store is not self.store:
            return None
        return AppendStep(self.store, self.events + other.events)


def store_txn_sink(store: AuditStore) -> Callable[[str, Mapping[str, Any]], AppendStep]:
    """Like ``store_sink``, but each event becomes a step that appends it inside the caller's synchronous
    transaction on the store's database, so it commits or rolls back together with the caller's writes.

    The event is built (and its fields checked) when the step is made, in the caller's context; the step
    raises whatever the database raises. Steps run one after another in one transaction can be joined
    (``AppendStep.then``).
    """

    def prepare(name: str, fields: Mapping[str, Any]) -> AppendStep:
        return AppendStep(store, (_to_event(name, fields),))

    return prepare
