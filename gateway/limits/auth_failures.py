"""Failed authentications: throttled per peer address, audited in batches that keep their counts."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.audit_hook import AuditHook, TxnRun, chain_steps

log = structlog.get_logger()

EVENT = "auth.failure"
OTHER_PEERS = "*"  # the peer of counts whose own key did not fit in the table
THROTTLED = "too_many_auth_failures"  # the reason (and 429 code) of a refused peer's requests


@dataclass(frozen=True, slots=True)
class AuthFailureLimits:
    """``limit`` failures per peer address per ``window_s`` (fixed, from its first failure); events
    written at most once per ``flush_s``; at most ``max_peers`` addresses remembered."""

    limit: int = 20
    window_s: float = 60.0
    flush_s: float = 1.0
    max_peers: int = 10_000

    @classmethod
    def from_settings(cls, settings: Any) -> AuthFailureLimits:
        return cls(
            settings.auth_failure_limit,
            settings.auth_failure_window_s,
            settings.auth_failure_flush_s,
            settings.auth_failure_max_peers,
        )


class AuthFailures:
    """Counts failed authentications per peer address: a peer past ``limit`` failures in its window is
    refused before its key is looked up (``retry_after``), and the failures are audited as one
    ``auth.failure`` event per (peer, reason, path) with ``num_failures``, at most once per ``flush_s``
    and in one transaction, so a flood of bad keys is not a flood of disk writes.

    The first failure after a quiet ``flush_s`` is written at once, by its own request; the rest wait
    for a background flush that ``keep`` hands to the runtime, which waits for it before shutting down:
    no count is lost. Counts of peers beyond ``max_peers`` are kept under the peer ``*``.

    Args:
        audit: Where the events go.
        run_txn: Runs one transaction (the runtime's ``TxnRunner.run``), for a batch of events.
        keep: Holds the background flush until it is done (``Runtime.keep_finishing``).
        limits: The thresholds.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        audit: AuditHook,
        run_txn: TxnRun,
        keep: Callable[[asyncio.Future], None],
        limits: AuthFailureLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._audit, self._run_txn, self._keep = audit, run_txn, keep
        self.limits = limits
        self._clock = clock
        self._windows: OrderedDict[str, list[float]] = OrderedDict()  # peer -> [window start, failures]
        self._pending: dict[tuple[str, str, str], int] = {}  # (peer, reason, path) -> failures
        self._next_flush_at = float("-inf")
        self._flusher: asyncio.Task | None = None

    def retry_after(self, peer: str) -> float | None:
        """Seconds until ``peer`` may try again, or ``None`` when it is not over its limit."""
        window = self._windows.get(peer)
        if window is None or window[1] < self.limits.limit:
            return None
        left = window[0] + self.limits.window_s - self._clock()
        return left if left > 0 else None

    async def record(self, peer: str, reason: str, path: str, *, may_write: bool) -> None:
        """Count one failure of ``peer``. It is written now if nothing was for ``flush_s`` and
        ``may_write`` (the request may wait for the database), else by the background flush."""
        now = self._clock()
        self._count(peer, now)
        key = (peer, reason, path)
        if key not in self._pending and len(self._pending) >= self.limits.max_peers:
            key = (OTHER_PEERS, reason, path)
        self._pending[key] = self._pending.get(key, 0) + 1
        if self._flusher is not None:
            return
        if may_write and now >= self._next_flush_at:
            writing = asyncio.ensure_future(self.flush())
            self._keep(writing)
            await asyncio.shield(writing)  # a client gone mid-write loses no count
            return
        self._flusher = asyncio.ensure_future(self._flush_after(self._next_flush_at - now))
        self._keep(self._flusher)

    async def flush(self) -> None:
        """Write every count not written yet, in one transaction (one event per peer, reason and path)."""
        self._next_flush_at = self._clock() + self.limits.flush_s
        batch, self._pending = self._pending, {}
        if not batch:
            return
        events = [
            {"peer": peer, "reason": reason, "path": path, "num_failures": n}
            for (peer, reason, path), n in batch.items()
        ]
        try:
            await self._write(events)
        except Exception as e:  # noqa: BLE001  (the requests are answered; the log keeps the count)
            num = sum(batch.values())
            log.error("audit.auth_failures_lost", num_failures=num, error_type=type(e).__name__)

    async def _flush_after(self, delay_s: float) -> None:
        await asyncio.sleep(max(delay_s, 0.0))
        self._flusher = None
        await self.flush()

    async def _write(self, events: list[dict[str, Any]]) -> None:
        steps = [self._audit.step(EVENT, **fields) for fields in events]
        step = chain_steps(*steps)
        if step is not None and all(s is not None for s in steps):
            await self._run_txn(step, inline=True)
            return
        for fields in events:  # a sink that cannot join a transaction (logs, or a custom sink)
            await self._audit.emit(EVENT, required=False, **fields)

    def _count(self, peer: str, now: float) -> None:
        window = self._windows.get(peer)
        if window is None or now - window[0] >= self.limits.window_s:
            window = self._windows[peer] = [now, 0]
        self._windows.move_to_end(peer)
        window[1] += 1
        if len(self._windows) > self.limits.max_peers:
            self._windows.popitem(last=False)
