"""Settling a request once it ended, however it ended: usage, quota, retention, audit and metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import structlog
from sqlalchemy import Connection, bindparam, select

from audit.tables import audit_events
from gateway.audit_hook import AuditUnavailableError, TxnStep
from gateway.inference import retention
from gateway.inference.admission import Admission
from gateway.inference.receipts import Receipt
from gateway.runtime import Runtime
from gateway.storage.db import is_db_transient

log = structlog.get_logger()
# A settlement that found the database out of reach or full is retried for this long, the pauses between tries
# doubling from the first to the second figure; then it is given up (logged as ``quota.settle_failed``:
# the reservation stays counted, and the slot held until this gateway stops).
SETTLE_RETRY_S = 300.0
SETTLE_PAUSE_S = (0.25, 5.0)


class Progress:
    """What the engine has produced so far, so an abort still settles real usage."""

    __slots__ = ("last", "num_tokens", "num_chars", "finished", "is_done")

    def __init__(self) -> None:
        self.last: Any = None
        self.num_tokens: dict[int, int] = {}
        self.num_chars: dict[int, int] = {}
        self.finished: set[int] = set()  # choices whose end a stream has sent (later outputs repeat it)
        self.is_done = False

    def usage(self, adm: Admission) -> tuple[int, int, int]:
        reported = getattr(self.last, "usage", None)  # an upstream server's own count
        if reported is not None:
            return reported
        num_completion = 0 if self.last is None else sum(len(o.token_ids) for o in self.last.outputs)
        num_cached = 0 if self.last is None else self.last.num_cached_tokens
        return adm.num_prompt_tokens, num_completion, num_cached


async def _maybe_retain(rt: Runtime, adm: Admission, last: Any) -> None:
    """Keep the prompt and what was generated, encrypted, when the tenant's policy asks for it."""
    if adm.retain_days and last is not None:
        texts = [o.text for o in last.outputs]
        tenant_id = adm.principal.tenant_id or ""
        await retention.retain(rt, tenant_id, adm.request_id, adm.retained_prompt, texts, adm.retain_days)


async def _settle_audited(rt: Runtime, adm: Admission, usage: tuple[int, int, int], fields: dict) -> None:
    """Settle and record ``request.finished`` in one transaction when the audit sink can join it. The
    event is not required (the work is done), so when it cannot be recorded the settlement still is.
    When the database is out of reach or full, the settlement is retried in the background
    (``_settle_later``)."""
    try:
        step = rt.audit.step("request.finished", **fields)
    except AuditUnavailableError:  # already logged; settle anyway, and emit() below tries once more
        step = None
    try:
        await _settle_once(rt, adm, usage, step)
    except Exception as e:  # noqa: BLE001
        if is_db_transient(e):
            log.warning("quota.settle_deferred", request_id=adm.request_id, error_type=type(e).__name__)
            rt.keep_finishing(asyncio.ensure_future(_settle_later(rt, adm, usage, step, fields)))
            return
        _log_failed(adm, e)
    if step is None:
        await rt.audit.emit("request.finished", required=False, **fields)


async def _settle_once(rt: Runtime, adm: Admission, usage: tuple[int, int, int], step: TxnStep | None,
                       unless: Callable[[Connection], bool] | None = None) -> None:
    try:
        await rt.quota.settle(adm.reservation, *usage, then=step, unless=unless)
    except AuditUnavailableError as e:
        if is_db_transient(e):  # the settlement cannot be written either
            raise
        await rt.quota.settle(adm.reservation, *usage, unless=unless)


async def _settle_later(rt: Runtime, adm: Admission, usage: tuple[int, int, int], step: TxnStep | None,
                        fields: dict) -> None:
    """Retry a settlement that found the database out of reach or full, with growing pauses, until it is
    written or ``SETTLE_RETRY_S`` has passed. A try that failed in its commit may have committed all the
    same (the connection was lost before the answer came): with its ``request.finished`` event in the
    same transaction, each later try first looks for that event and settles nothing twice."""
    unless = None if step is None else partial(_is_finished, adm.principal.tenant_id, adm.request_id)
    deadline, pause = time.monotonic() + SETTLE_RETRY_S, SETTLE_PAUSE_S[0]
    while True:
        await asyncio.sleep(pause)
        try:
            await _settle_once(rt, adm, usage, step, unless)
            break
        except Exception as e:  # noqa: BLE001
            if not is_db_transient(e) or time.monotonic() + pause > deadline:
                _log_failed(adm, e)
                return
        pause = min(2 * pause, SETTLE_PAUSE_S[1])
    log.info("quota.settled_late", request_id=adm.request_id)
    if step is None:
        await rt.audit.emit("request.finished", required=False, **fields)


def _log_failed(adm: Admission, e: Exception) -> None:
    log.error("quota.settle_failed", request_id=adm.request_id, error_type=type(e).__name__, exc_info=e)


_FINISHED = (
    select(audit_events.c.seq)
    .where(audit_events.c.tenant_id == bindparam("tid"), audit_events.c.request_id == bindparam("rid"),
           audit_events.c.name == "request.finished")
    .limit(1)
)


def _is_finished(tenant_id: str | None, request_id: str, conn: Connection) -> bool:
    """Whether the request's ``request.finished`` event, and so its settlement, is already committed."""
    return conn.execute(_FINISHED, {"tid": tenant_id, "rid": request_id}).first() is not None


def _finished_fields(adm: Admission, last: Any, usage: tuple[int, int, int], is_done: bool) -> dict[str, Any]:
    """``request.finished``'s fields: what the request used, and its determinism receipt."""
    num_prompt, num_completion, num_cached = usage
    return {
        "request_id": adm.request_id,
        "tenant_id": adm.principal.tenant_id,
        "key_id": adm.principal.key_id,
        "finish_reasons": [] if last is None else [o.finish_reason for o in last.outputs],
        "num_prompt_tokens": num_prompt,
        "num_completion_tokens": num_completion,
        "num_cached_tokens": num_cached,
        "is_aborted": not is_done,
        **Receipt.of(adm, last).fields(),  # the determinism receipt `kvgate replay` checks
    }


async def settle_unstarted(rt: Runtime, adm: Admission, status_code: int) -> None:
    """Settle an admitted request that never reached the engine (refused its place once reserved, with
    ``status_code``): its claim, hold, slot and reserved tokens all given back, nothing charged, and its
    ``request.finished`` recorded with no usage and that status. Shielded, as ``finish`` is."""
    with anyio.CancelScope(shield=True):
        if adm.place is not None:
            adm.place.give(is_finished=False)
        if not await _is_committed(adm):  # nothing was reserved or recorded: nothing to settle
            return
        fields = _finished_fields(adm, None, (0, 0, 0), False) | {"status_code": status_code}
        await _settle_audited(rt, adm, (0, 0, 0), fields)


async def finish(rt: Runtime, adm: Admission, progress: Progress) -> None:
    """Settle, record metrics and audit. Shielded: it must complete even when the client went away."""
    with anyio.CancelScope(shield=True):
        if not progress.is_done and adm.upstream is None:  # an upstream's stream is closed by its reader
            rt.engine.abort(adm.request_id)  # on its way before any later request's add
        if adm.place is not None:
            adm.place.give()
        if not await _is_committed(adm):  # nothing was reserved or recorded: nothing to settle
            return
        num_prompt, num_completion, num_cached = usage = progress.usage(adm)
        last = progress.last
        await _maybe_retain(rt, adm, last)
        await _settle_audited(rt, adm, usage, _finished_fields(adm, last, usage, progress.is_done))
        m = None if last is None else last.metrics
        rt.metrics.observe_finished(
            adm.principal.tenant_id or "",
            adm.kind,
            "ok" if progress.is_done else "aborted",
            num_prompt,
            num_completion,
            getattr(m, "time_to_first_token", None),
            getattr(m, "mean_time_per_output_token", None),
        )


async def finish_soon(rt: Runtime, adm: Admission, progress: Progress) -> asyncio.Future | None:
    """Finish a whole response's request: now, or, where this process's transactions run in the order
    they start (SQLite's writer), as a task started here, whose settlement transaction is queued before
    the response is even sent. Any later request of this process is then admitted after the settlement
    (a one-at-a-time tenant's next request finds its slot free); the client just does not wait for the
    commit. Returns that task, for the reply to await once it is sent, or ``None``."""
    if not rt.txn.is_ordered or adm.retain_days:  # retention awaits its own write before the settlement
        await finish(rt, adm, progress)
        return None
    # The task's first step runs before any I/O the response can provoke, and queues the settlement
    # without awaiting anything before it (``_finish`` reaches ``TxnRunner.run`` synchronously).
    finishing = asyncio.ensure_future(finish(rt, adm, progress))
    rt.keep_finishing(finishing)
    return finishing


async def _is_committed(adm: Admission) -> bool:
    try:
        await until_committed(adm)
    except Exception:  # noqa: BLE001  (the request that waited for it reports the error)
        return False
    return True


async def until_committed(adm: Admission) -> None:
    """Wait until the admission's reservation (and its audit events) are committed: the engine may start
    before, but nothing it produced is shown before. If the commit fails, so does the request."""
    if adm.reservation.committed is not None:
        await adm.reservation.committed
