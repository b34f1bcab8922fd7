"""Engine admission: a bounded number of requests past admission, refused at once beyond it.

Every request the gateway admits holds one place from its reservation until its settlement starts: a
whole response's last token, a stream's last byte handed to its connection, or its abort. Places are
``max_num_seqs`` (the engine's batch) plus ``max_queued`` (requests that may wait for a place in it), so
the engine's waiting queue, the pipe to it and the outputs held for clients never grow past that many
requests. One request more is answered at once with a 503 ``engine_overloaded``.

A request first *claims* its place, before its prompt is read, so that a full gate refuses it cheaply;
the claim becomes the place once the tenant's reservation has decided (``EnginePlace.take``). A claim
counts against its own tenant only: a burst that the tenant's limits will refuse (another replica's
requests fill its rate, say) never took a place another tenant's request needed.

Each tenant has a share of the places, ``limit * weight / total weight`` over the tenants that hold,
claim or were just refused one. A tenant holding at least its share is refused (a 429
``engine_share_exceeded``: its own over-use) unless more places are free than the headroom plus what
the other tenants' requests in admission need to reach their shares; a tenant under its share is
refused only when no place is free. A tenant alone may use every place.

Its ``Retry-After`` comes from the measured drain rate: the requests ahead of a newcomer
(``queued / drain_rate``), clamped to [1, 60] s. The rate counts places given back per second of busy
time (some place held), weighted exponentially, so an idle hour neither dilutes nor ages the estimate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import EngineOverloaded
from gateway.limits.ratelimit import exceeded

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
DRAIN_TIME_CONSTANT_S = 10.0  # about the last 10 s of busy time weigh in the rate
# A tenant refused for want of a place competes for one until the Retry-After it was told, and this long
# after (its retry is on its way).
WAIT_GRACE_S = 2.0


def retry_after_s(num_ahead: float, rate: float | None) -> int:
    """Whole seconds until ``num_ahead`` requests drained at ``rate`` per second, clamped to [1, 60].
    Nothing measured yet (``None``): the minimum."""
    if rate is None:
        return RETRY_AFTER_MIN_S
    if rate <= 0:
        return RETRY_AFTER_MAX_S
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(num_ahead / rate)))


class DrainRate:
    """Finished requests per second of busy time, exponentially weighted (time constant ``tau_s``).

    Both the count and the busy time decay with busy time alone: ``count / span`` is then the rate over
    roughly the last ``tau_s`` busy seconds, and early on (less busy time than ``tau_s``) simply the count
    over the busy time so far, without the bias of an average that starts at zero. Callers pass ``now``
    (any monotonic clock), so the estimator is a pure function of what it was told.
    """

    __slots__ = ("_tau", "_count", "_span", "_last", "_is_busy")

    def __init__(self, tau_s: float = DRAIN_TIME_CONSTANT_S) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self._tau = tau_s
        self._count = 0.0  # decayed finished requests
        self._span = 0.0  # decayed busy seconds
        self._last: float | None = None
        self._is_busy = False

    def set_busy(self, now: float, is_busy: bool) -> None:
        """From ``now`` on, time counts (some request is in flight) or not (idle)."""
        self._advance(now)
        self._is_busy = is_busy

    def add(self, now: float, num_finished: int = 1) -> None:
        """``num_finished`` requests gave back their places at ``now``."""
        self._advance(now)
        self._count += num_finished

    def per_second(self, now: float) -> float | None:
        """The rate; ``None`` before any busy time. Fewer than one finished in the weighted window reads
        as one: while nothing finishes the estimate falls toward one per ``tau_s``, never to zero."""
        self._advance(now)
        if self._span <= 0:
            return None
        return max(self._count, 1.0) / self._span

    def _advance(self, now: float) -> None:
        if self._last is not None and self._is_busy and now > self._last:
            decay = math.exp(-(now - self._last) / self._tau)
            self._count *= decay
            self._span = self._span * decay + self._tau * (1.0 - decay)
        if self._last is None or now > self._last:
            self._last = now


@dataclass(slots=True)
class _Tenant:
    """One tenant's part of the gate."""

    weight: float = 1.0
    num_held: int = 0  # places: requests whose reservation decided, until their settlement starts
    num_claimed: int = 0  # claims: requests past the tenant's own limits, before their reservation
    waits_until: float = -math.inf  # refused for want of a place (503): competing for one until then

    def is_idle(self, now: float) -> bool:
        return self.num_held == 0 and self.num_claimed == 0 and self.waits_until <= now


class EnginePlace:
    """One admitted request's place: claimed before its prompt is read, taken once its reservation has
    decided. ``give`` is idempotent (every way a request ends may call it), whichever it holds."""

    __slots__ = ("_gate", "tenant_id", "is_claimed", "is_held")

    def __init__(self, gate: EngineGate, tenant_id: str) -> None:
        self._gate, self.tenant_id = gate, tenant_id
        self.is_claimed, self.is_held = True, False

    def take(self) -> None:
        """Turn the claim into the place (the claim stays, for ``give``, if refused).

        Raises:
            EngineOverloaded: No place is free (503 ``engine_overloaded``).
            QuotaExceeded: The tenant holds its share while other tenants need the places left (429
                ``engine_share_exceeded``).
        """
        if not self.is_claimed:
            raise RuntimeError("a place is taken once, from its claim")
        self._gate._take(self.tenant_id)
        self.is_claimed, self.is_held = False, True

    def give(self, *, is_finished: bool = True) -> None:
        """Give the claim or the place back: ``is_finished`` when the engine worked on the request (it
        counts in the drain rate), not when admission refused it."""
        if self.is_claimed or self.is_held:
            was_held, self.is_claimed, self.is_held = self.is_held, False, False
            self._gate._give(self.tenant_id, was_held, is_finished)


class EngineGate:
    """The places of one gateway process (see the module docstring); on its event loop only.

    Args:
        num_running: The engine's batch (``max_num_seqs``): requests beyond it wait in its queue.
        max_queued: Requests that may wait beyond the batch.
        clock: Monotonic seconds (tests pass their own).
        tau_s: The drain rate's time constant.
        headroom: The fraction of the places a tenant at its share leaves free for the others.
    """

    def __init__(self, num_running: int, max_queued: int, clock: Callable[[], float] = time.monotonic,
                 tau_s: float = DRAIN_TIME_CONSTANT_S, headroom: float = 0.0) -> None:
        if num_running < 1 or max_queued < 0 or not 0 <= headroom < 1:
            raise ValueError("num_running must be positive, max_queued not negative, headroom in [0, 1)")
        self.num_running, self.limit = num_running, num_running + max_queued
        self.num_headroom = math.ceil(self.limit * headroom)
        self.num_in_flight = 0
        self.drain = DrainRate(tau_s)
        self._clock = clock
        # Tenants holding or claiming places, or waiting for one (remembered while fewer than the places).
        self._tenants: dict[str, _Tenant] = {}

    def claim(self, tenant_id: str, weight: float = 1.0) -> EnginePlace:
        """A claim on a place for one more request of ``tenant_id`` (``weight``: its policy's share), which
        ``EnginePlace.take`` turns into the place once its reservation has decided.

        Raises:
            EngineOverloaded: No place is free for it (503 ``engine_overloaded`` with ``Retry-After``).
            QuotaExceeded: The tenant holds or claims its share while other tenants need the places left
                (429 ``engine_share_exceeded`` with ``Retry-After``).
        """
        t = self._tenants.get(tenant_id) or _Tenant()
        t.weight = weight
        self._check(tenant_id, t, t.num_held + t.num_claimed, self.limit - self.num_in_flight - t.num_claimed)
        t.num_claimed += 1
        t.waits_until = -math.inf
        self._tenants[tenant_id] = t
        return EnginePlace(self, tenant_id)

    def retry_after_s(self) -> int:
        """The wait a refused request is told: the requests queued ahead of it over the drain rate."""
        num_queued = max(1, self.num_in_flight - self.num_running)
        return retry_after_s(num_queued, self.drain.per_second(self._clock()))

    def tenant_wait_s(self, num_held: int) -> int:
        """The wait a tenant at its concurrency limit (or its share) is told: until one of its
        ``num_held`` requests is likely done, if every request in flight drains at the same pace."""
        share = max(1, self.num_in_flight) / max(1, num_held)
        return retry_after_s(share, self.drain.per_second(self._clock()))

    def drain_per_second(self) -> float:
        """The measured drain rate (0 before any): for the metrics."""
        return self.drain.per_second(self._clock()) or 0.0

    def num_places(self, tenant_id: str) -> tuple[int, int]:
        """``tenant_id``'s places and claims."""
        t = self._tenants.get(tenant_id)
        return (0, 0) if t is None else (t.num_held, t.num_claimed)

    def _check(self, tenant_id: str, t: _Tenant, num_used: int, num_free: int) -> None:
        """Raise unless a request of ``tenant_id``, which holds ``num_used`` places (and claims), may have
        one of the ``num_free`` places free for it."""
        now = self._clock()
        others = self._others(tenant_id, now)
        total_weight = t.weight + sum(o.weight for o in others)
        if others and num_used >= self.limit * t.weight / total_weight:
            if num_free > self.num_headroom + self._num_owed(others, total_weight, now):
                return
            raise exceeded(
                "This tenant holds its share of the server's engine places while other tenants wait for "
                "one; retry after the time in Retry-After.",
                self.tenant_wait_s(max(1, num_used)), "engine_share_exceeded")
        if num_free > 0:
            return
        retry_after = self.retry_after_s()
        if tenant_id in self._tenants or len(self._tenants) < self.limit:
            t.waits_until = now + retry_after + WAIT_GRACE_S
            self._tenants[tenant_id] = t
        raise EngineOverloaded(
            "The server is overloaded: too many requests are waiting for the engine; retry after the "
            "time in Retry-After.",
            headers={"Retry-After": str(retry_after)},
        )

    def _others(self, tenant_id: str, now: float) -> list[_Tenant]:
        """The other tenants competing for places (those that no longer are are forgotten)."""
        for idle in [k for k, o in self._tenants.items() if o.is_idle(now)]:
            del self._tenants[idle]
        return [o for k, o in self._tenants.items() if k != tenant_id]

    def _num_owed(self, others: list[_Tenant], total_weight: float, now: float) -> int:
        """The places the other tenants' requests in admission (or a retry of a refused one) need to
        reach their shares."""
        num = 0
        for o in others:
            wanted = o.num_claimed or (1 if o.waits_until > now else 0)
            num += max(0, min(wanted, math.ceil(self.limit * o.weight / total_weight) - o.num_held))
        return num

    def _take(self, tenant_id: str) -> None:
        t = self._tenants[tenant_id]
        self._check(tenant_id, t, t.num_held, self.limit - self.num_in_flight)
        t.num_claimed -= 1
        t.num_held += 1
        if self.num_in_flight == 0:
            self.drain.set_busy(self._clock(), True)
        self.num_in_flight += 1

    def _give(self, tenant_id: str, was_held: bool, is_finished: bool) -> None:
        t = self._tenants[tenant_id]
        now = self._clock()
        if not was_held:
            t.num_claimed -= 1
        else:
            t.num_held -= 1
            if is_finished:
                self.drain.add(now)
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self.drain.set_busy(now, False)
        if t.is_idle(now):
            del self._tenants[tenant_id]
