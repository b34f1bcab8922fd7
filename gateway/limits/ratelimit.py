"""Rate-limit answers (OpenAI's ``x-ratelimit-*`` headers, the 429 errors) and the in-process gate."""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import QuotaExceeded
from policies import Policy


@dataclass(frozen=True, slots=True)
class RateLimitInfo:
    """Values for OpenAI's ``x-ratelimit-*`` headers (minute window)."""

    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_s: float

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        reset = f"{max(self.reset_s, 0.0):.3f}s"
        if self.limit_requests is not None:
            out |= {
                "x-ratelimit-limit-requests": str(self.limit_requests),
                "x-ratelimit-remaining-requests": str(max(self.remaining_requests or 0, 0)),
                "x-ratelimit-reset-requests": reset,
            }
        if self.limit_tokens is not None:
            out |= {
                "x-ratelimit-limit-tokens": str(self.limit_tokens),
                "x-ratelimit-remaining-tokens": str(max(self.remaining_tokens or 0, 0)),
                "x-ratelimit-reset-tokens": reset,
            }
        return out


def rate_limit_info(policy: Policy, minute: tuple[int, int], reset_s: float) -> RateLimitInfo:
    tokens, requests = minute
    rpm, tpm = policy.requests_per_minute, policy.tokens_per_minute
    return RateLimitInfo(
        rpm, None if rpm is None else rpm - requests, tpm, None if tpm is None else tpm - tokens, reset_s
    )


def exceeded(message: str, retry_after: float, code: str) -> QuotaExceeded:
    return QuotaExceeded(message, code=code, headers={"retry-after": str(max(1, math.ceil(retry_after)))})


def window_error(
    window: str, num_tokens: int, limits: tuple[int | None, int | None], retry_after: float
) -> QuotaExceeded:
    token_limit, _ = limits
    if token_limit is not None and num_tokens > token_limit:
        return exceeded(
            f"Request too large: it needs {num_tokens} tokens; the {window} limit is {token_limit}.",
            retry_after,
            "request_too_large",
        )
    if window == "minute":
        return exceeded(
            "Rate limit reached for requests or tokens per minute.", retry_after, "rate_limit_exceeded"
        )
    return exceeded(
        f"The {'daily' if window == 'day' else 'monthly'} token quota is exhausted.",
        retry_after,
        "insufficient_quota",
    )


@dataclass(slots=True)
class _TenantCounts:
    num_in_flight: int = 0  # this process's requests from the gate to their settlement
    num_pending: int = 0  # of those, the ones the database's minute count does not hold yet
    minute_start: int = -1  # the minute window whose database request count was last seen
    num_minute_requests: int = 0  # that count (it only grows within its minute)

    def num_requests(self, minute_start: int) -> int:
        """The database's count for minute ``minute_start`` as last seen: 0 for a minute not seen yet (the
        requests this process has pending still count: ``num_pending``)."""
        return self.num_minute_requests if self.minute_start == minute_start else 0

    def observe(self, minute_start: int, num_requests: int) -> None:
        if minute_start > self.minute_start:
            self.minute_start, self.num_minute_requests = minute_start, num_requests
        elif minute_start == self.minute_start:
            self.num_minute_requests = max(self.num_minute_requests, num_requests)


class Hold:
    """One request's place in its tenant's gate counts, from the gate to its settlement (or refusal).
    ``give`` is idempotent: every way a request ends may call it."""

    __slots__ = ("_counts", "_is_pending", "_is_held")

    def __init__(self, counts: _TenantCounts) -> None:
        self._counts = counts
        self._is_pending = self._is_held = True
        counts.num_in_flight += 1
        counts.num_pending += 1

    def counted(self, minute_start: int, num_requests: int) -> None:
        """The database's minute window now holds the request: it had ``num_requests`` with it."""
        self._unpend()
        self._counts.observe(minute_start, num_requests)

    def counted_once(self, committed: asyncio.Future | None, minute_start: int, num_requests: int) -> None:
        """``counted`` once ``committed`` (the reservation's commit; ``None``: done) has succeeded; if it
        failed, nothing holds the request any more: ``give``."""
        if committed is None:
            self.counted(minute_start, num_requests)
            return

        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self.counted(minute_start, num_requests)
            else:
                self.give()

        committed.add_done_callback(done)

    def give(self) -> None:
        """The request is settled or refused."""
        self._unpend()
        if self._is_held:
            self._is_held = False
            self._counts.num_in_flight -= 1

    def _unpend(self) -> None:
        if self._is_pending:
            self._is_pending = False
            self._counts.num_pending -= 1


class TenantGate:
    """Refuses a tenant's request at its concurrency or requests-per-minute limit before any work that
    grows with the prompt (tokenizing), from what this process knows without asking the database: its
    own requests in flight, and the tenant's request count in the database's minute window as last seen
    (it only grows within a minute) plus this process's requests between the gate and their
    reservation, also in a minute not seen yet: a burst gets at most the limit through at once, however
    many arrive before the first reservation is back. The database's reservation stays the authority
    (other gateway instances count there); this only answers early what it would.

    A request counts from the gate on (``take``), so a request still being tokenized already holds its
    slot and its place in the minute; whatever refuses it later gives them back (``Hold.give``).

    Args:
        max_tenants: Tenants remembered (least recently seen forgotten first: a forgotten tenant's
            requests in flight keep their holds, the gate just stops counting them, erring toward the
            database's answer).
    """

    def __init__(self, max_tenants: int = 65_536) -> None:
        self._tenants: OrderedDict[str, _TenantCounts] = OrderedDict()
        self._max_tenants = max_tenants

    def take(self, tenant_id: str, policy: Policy, now: float,
             wait_s: Callable[[int], float] | None = None) -> Hold:
        """A hold for one more request of ``tenant_id``; ``wait_s(num_held)`` says how long a tenant at
        its concurrency limit with ``num_held`` requests in flight should wait (1 s without it).

        Raises:
            QuotaExceeded: At ``max_concurrent_requests`` or ``requests_per_minute`` (429).
        """
        counts = self._counts(tenant_id)
        limit = policy.max_concurrent_requests
        if limit is not None and counts.num_in_flight >= limit:
            retry_after = 1.0 if wait_s is None else wait_s(counts.num_in_flight)
            raise exceeded("Too many concurrent requests for this tenant.", retry_after, "concurrency_limit")
        rpm, minute_start = policy.requests_per_minute, int(now // 60) * 60
        if rpm is not None and counts.num_requests(minute_start) + counts.num_pending >= rpm:
            reset_s = minute_start + 60 - now
            error = exceeded(
                "Rate limit reached for requests or tokens per minute.", reset_s, "rate_limit_exceeded"
            )
            error.headers |= RateLimitInfo(rpm, 0, None, None, reset_s).headers()
            raise error
        return Hold(counts)

    def observe(self, tenant_id: str, minute_start: int, num_requests: int) -> None:
        """The database's minute window ``minute_start`` holds ``num_requests`` of the tenant's."""
        self._counts(tenant_id).observe(minute_start, num_requests)

    def num_in_flight(self, tenant_id: str) -> int:
        """This process's requests of ``tenant_id`` past the gate and not yet settled or refused."""
        counts = self._tenants.get(tenant_id)
        return 0 if counts is None else counts.num_in_flight

    def _counts(self, tenant_id: str) -> _TenantCounts:
        counts = self._tenants.get(tenant_id)
        if counts is None:
            counts = self._tenants[tenant_id] = _TenantCounts()
            if len(self._tenants) > self._max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant_id)
        return counts
