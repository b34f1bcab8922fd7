"""The one place the request path reports auditable events; the audit package plugs its writer in here.

Events (``name`` → fields; never prompts, completions or secrets):
    auth.success / auth.failure     key_id, tenant_id, kind, reason, path
    request.admitted                request_id, tenant_id, key_id, model, num_prompt_tokens,
                                    prompt_hash, num_reserved_tokens, max_tokens, priority, determinism,
                                    features (names only: json_schema, tools, ...; never a schema)
    request.rejected                request_id, tenant_id, key_id, code, status
    request.finished                request_id, tenant_id, key_id, finish_reasons, num_prompt_tokens,
                                    num_completion_tokens, num_cached_tokens, is_aborted, and the
                                    determinism receipt (gateway/inference/receipts.py): kind, model,
                                    determinism, system_fingerprint, prompt_hash, every sampling
                                    parameter by name, structured_kind and structured_hash,
                                    arrival_step, token_hashes (fixed/batch_invariant)
    admin.<action>                  actor (admin token id, or "cli:<os user>" for ``kvgate admin``),
                                    tenant_id, key_id, version, ... (gateway/tenancy/admin_audit.py)
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import structlog
from sqlalchemy import Connection

AuditSink = Callable[[str, Mapping[str, Any]], Awaitable[None] | None]
TxnStep = Callable[[Connection], None]
# Makes an event into a step that appends it inside a caller's synchronous database transaction.
TxnSink = Callable[[str, Mapping[str, Any]], TxnStep]
TxnRun = Callable[..., Awaitable[None]]  # run(step, durable=..., inline=...)

log = structlog.get_logger("kvgate.audit")


def log_sink(name: str, fields: Mapping[str, Any]) -> None:
    """Default sink: one structured log line per event."""
    log.info(name, **fields)


class AuditUnavailableError(Exception):
    """The audit trail could not record an event; the gateway answers 503 rather than act unaudited."""


class AuditHook:
    """Calls the configured sink. Fails closed: a sink error raises ``AuditUnavailableError``, except for
    events emitted with ``required=False`` (after the work is done, e.g. ``request.finished``), which are
    logged instead because there is nothing left to refuse.

    With a transactional sink (the audit store on the gateway's own database) an event can also join the
    transaction that does the work it records (``step``): the quota reservation and its
    ``request.admitted`` event then commit together or not at all, in one database round trip.
    """

    def __init__(self, sink: AuditSink | None = None) -> None:
        self._sink = sink or log_sink
        self._txn_sink: TxnSink | None = None
        self._txn_run: TxnRun | None = None

    def set_sink(self, sink: AuditSink) -> None:
        self._sink = sink
        self._txn_sink = self._txn_run = None

    @property
    def is_transactional(self) -> bool:
        """Whether events can join the caller's database transaction (``step`` returns a step)."""
        return self._txn_sink is not None

    def set_txn_sink(self, txn_sink: TxnSink, run: TxnRun) -> None:
        """Record every event inside a database transaction: ``run`` executes a lone step in its own."""
        self._txn_sink, self._txn_run = txn_sink, run

    async def emit(self, name: str, *, required: bool = True, durable: bool = True, **fields: Any) -> None:
        """Record one event. ``durable=False``: a transactional sink does not wait for the disk (see
        ``TxnRunner.run``); the next durable commit makes it durable too."""
        with _failing_closed(name, required):
            if self._txn_sink is not None and self._txn_run is not None:
                step = self._txn_sink(name, fields)
                # A large event (an admin change's snapshots) is scrubbed on a worker thread first: the
                # step may run on the event loop. Request-path events are small, so ``step`` needs none.
                off_loop = getattr(step, "redacted_off_loop", None)
                if off_loop is not None:
                    step = await off_loop()
                await self._txn_run(step, durable=durable, inline=True)
                return
            result = self._sink(name, fields)
            if inspect.isawaitable(result):
                await result

    def step(self, name: str, **fields: Any) -> TxnStep | None:
        """The event as a step for the caller's transaction, or ``None`` when the sink cannot join one
        (then ``emit`` it). The step raises ``AuditUnavailableError`` on failure, which must abort the
        transaction: the event is always required."""
        if self._txn_sink is None:
            return None
        with _failing_closed(name, True):
            append = self._txn_sink(name, fields)
        return _EventStep(name, append)


class _EventStep:
    """An event's step: a failure raises ``AuditUnavailableError``. Consecutive ones whose appends can be
    joined (``then``) run as one append (``chain_steps``)."""

    __slots__ = ("name", "append")

    def __init__(self, name: str, append: TxnStep) -> None:
        self.name = name
        self.append = append

    def __call__(self, conn: Connection) -> None:
        with _failing_closed(self.name, True):
            self.append(conn)

    def then(self, other: object) -> _EventStep | None:
        join = getattr(self.append, "then", None)
        if not isinstance(other, _EventStep) or join is None:
            return None
        joined = join(other.append)
        return None if joined is None else _EventStep(f"{self.name}+{other.name}", joined)


class DeferredEvent:
    """An event recorded later, inside the first transaction of the work it belongs to, or on its own
    when that work never starts: ``auth.success`` rides in a completion's admission transaction, so the
    request commits once before the engine runs instead of twice.

    Whoever records it calls ``step()`` and, once that transaction committed, ``mark_recorded()``; the
    request's outermost layer calls ``flush()`` at the end, which records it if nobody did.
    """

    __slots__ = ("name", "fields", "is_recorded")

    def __init__(self, name: str, fields: dict[str, Any]) -> None:
        self.name = name
        self.fields = fields
        self.is_recorded = False

    def step(self, hook: AuditHook) -> TxnStep | None:
        """The event as a step for a transaction (``None`` when already recorded or the sink cannot
        join one)."""
        return None if self.is_recorded else hook.step(self.name, **self.fields)

    def mark_recorded(self) -> None:
        self.is_recorded = True

    async def flush(self, hook: AuditHook) -> None:
        """Record it now if nobody has. Not required: by then the work is refused or done."""
        if not self.is_recorded:
            self.is_recorded = True
            await hook.emit(self.name, required=False, durable=False, **self.fields)


def chain_steps(*steps: TxnStep | None) -> TxnStep | None:
    """One step running ``steps`` in order (``None`` ones skipped); ``None`` when there are none.
    Adjacent audit events that can share one append are joined."""
    present: list[TxnStep] = []
    for step in steps:
        if step is None:
            continue
        joined = present[-1].then(step) if present and isinstance(present[-1], _EventStep) else None
        if joined is not None:
            present[-1] = joined
        else:
            present.append(step)
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def run(conn: Connection) -> None:
        for step in present:
            step(conn)

    return run


@contextmanager
def _failing_closed(name: str, required: bool) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        log.error("audit.sink_failed", event_name=name, error_type=type(e).__name__)
        if required:
            raise AuditUnavailableError(name) from e
