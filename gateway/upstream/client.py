"""One upstream pool's connections: health checks, and sending a request with retries before its first
byte, per-upstream timeouts and circuit breakers; what a reply may hold is bounded here."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from gateway.schemas.routes import UpstreamRoute
from gateway.upstream.addresses import transport
from gateway.upstream.pool import Replica, ReplicaSet

log = structlog.get_logger()
HEALTH_PATHS = {"vllm": "/health", "sglang": "/health", "llamacpp": "/health", "kvgate": "/readyz",
                "openai-compatible": "/v1/models"}
# Replies that say "not this replica, not now": the request did no work there, so another may take it.
RETRY_STATUSES = frozenset({502, 503, 504})
# "Too busy now" (503, 429): a replica under load, not a broken one, so its breaker stays as it is.
BUSY_STATUSES = frozenset({429, 503})


class UpstreamUnavailable(Exception):
    """No replica of the pool could take the request (all down, open, or failing before a byte)."""


class UpstreamReplyError(RuntimeError):
    """An upstream reply over one of this gateway's bounds (a line, the reply's bytes, its deadline)."""


@dataclass(frozen=True, slots=True)
class ReplyLimits:
    """Where upstreams may be, and what one reply may hold (the ``upstream_*`` settings)."""

    allow_private: bool = False
    max_error_bytes: int = 65_536
    max_line_bytes: int = 1_048_576
    max_reply_bytes: int = 67_108_864

    @classmethod
    def from_settings(cls, s: Any) -> ReplyLimits:
        return cls(s.upstream_allow_private_addresses, s.upstream_max_error_bytes, s.upstream_max_line_bytes,
                   s.upstream_max_reply_bytes)


@dataclass
class Opened:
    """A reply whose head has come from ``replica``; ``close`` ends it and tells the breaker how it went.
    ``deadline`` (the event loop's clock) is when the whole reply must be in."""

    pool: UpstreamPool
    replica: Replica
    response: httpx.Response
    deadline: float
    _is_closed: bool = field(default=False, init=False)

    async def chunks(self) -> AsyncIterator[str]:
        """The body's lines: each data line within the pool's idle timeout of the one before (comments
        and blank lines, an upstream's keepalives, do not reset it), all before ``deadline``.

        Raises:
            TimeoutError: A deadline passed.
            UpstreamReplyError: A line or the reply over its bound.
        """
        loop, idle_s = asyncio.get_running_loop(), self.pool.route.timeouts.idle_s
        lines = self._lines()
        idle_until = loop.time() + idle_s
        while True:
            try:
                async with asyncio.timeout_at(min(idle_until, self.deadline)):
                    line = await anext(lines)
            except StopAsyncIteration:
                return
            if line and not line.startswith(":"):
                idle_until = loop.time() + idle_s
            yield line

    async def _lines(self) -> AsyncIterator[str]:
        """The raw body split into lines, none longer than the pool's cap, in all no more than its cap
        (raw: the request asks for no compression, so no decoder can expand a small read)."""
        limits = self.pool.limits
        num_bytes, rest = 0, b""
        async for piece in self.response.aiter_raw():
            num_bytes += len(piece)
            if num_bytes > limits.max_reply_bytes:
                raise UpstreamReplyError(f"the reply is over {limits.max_reply_bytes} bytes")
            *lines, rest = (rest + piece).split(b"\n")
            if len(rest) > limits.max_line_bytes or any(len(x) > limits.max_line_bytes for x in lines):
                raise UpstreamReplyError(f"a line of the reply is over {limits.max_line_bytes} bytes")
            for line in lines:
                yield line.rstrip(b"\r").decode(errors="replace")
        if rest:
            yield rest.decode(errors="replace")

    async def read_error(self) -> bytes:
        """The start of an error reply's body (at most the pool's cap, within its idle timeout): enough
        for its message, never the whole of what an upstream might send."""
        cap, out = self.pool.limits.max_error_bytes, bytearray()
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            async with asyncio.timeout(self.pool.route.timeouts.idle_s):
                async for piece in self.response.aiter_raw():
                    out += piece
                    if len(out) >= cap:
                        break
        return bytes(out[:cap])

    async def close(self, *, is_ok: bool | None) -> None:
        """End the reply: ``is_ok`` tells the breaker how the replica did (``None``: nothing to tell, the
        client left, or the replica was busy)."""
        if self._is_closed:
            return
        self._is_closed = True
        self.replica.num_outstanding -= 1
        if is_ok:
            self.pool.replicas.on_success(self.replica)
        elif is_ok is not None:
            self.pool.fail(self.replica)
        else:
            self.pool.replicas.on_abandoned(self.replica)
        await self.response.aclose()


class UpstreamPool:
    """A route's version: its replicas, one HTTP client over them, and a health task."""

    def __init__(self, name: str, version: int, route: UpstreamRoute, api_key: str | None,
                 limits: ReplyLimits) -> None:
        self.name, self.version, self.route, self.limits = name, version, route, limits
        self.replicas = ReplicaSet(route.urls, slack=route.affinity_slack,
                                   failures_to_open=route.failures_to_open, open_s=route.open_s)
        t = route.timeouts
        limits = httpx.Limits(max_connections=route.max_connections * len(route.urls),
                              max_keepalive_connections=route.max_connections * len(route.urls))
        headers = {"Accept-Encoding": "identity"}  # raw bytes: what the caps count is what is held
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.AsyncClient(
            headers=headers, transport=transport(limits, allow_private=self.limits.allow_private),
            trust_env=False,
            timeout=httpx.Timeout(connect=t.connect_s, read=t.first_byte_s, write=t.idle_s, pool=t.connect_s),
        )
        self.num_retries = 0
        self._health: asyncio.Task | None = None

    def start(self) -> None:
        self._health = asyncio.create_task(self._check_health_forever())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        await self.client.aclose()

    def fail(self, replica: Replica) -> None:
        if self.replicas.on_failure(replica, time.monotonic()):
            log.warning("upstream.breaker_open", model=self.name, url=replica.url,
                        num_failures=replica.num_failures)

    async def check_health(self) -> None:
        """One round of health checks, each within the connect timeout plus a second."""
        path = HEALTH_PATHS[self.route.kind]
        deadline = self.route.timeouts.connect_s + 1.0
        results = await asyncio.gather(*(self._is_healthy(r.url + path, deadline)
                                         for r in self.replicas.replicas))
        for replica, is_healthy in zip(self.replicas.replicas, results, strict=True):
            if is_healthy is None:
                continue
            if replica.is_healthy != is_healthy:
                log.info("upstream.health", model=self.name, url=replica.url, is_healthy=is_healthy)
            replica.is_healthy = is_healthy

    async def _is_healthy(self, url: str, deadline: float) -> bool | None:
        """Whether the replica answered 200; ``None``: no verdict (this gateway's connections to the
        pool were all in use, which says nothing of the replica)."""
        try:  # the status alone: the body is never read
            async with asyncio.timeout(deadline), self.client.stream("GET", url) as r:
                return r.status_code == 200
        except httpx.PoolTimeout:
            return None
        except (httpx.HTTPError, TimeoutError):
            return False

    async def _check_health_forever(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.route.health_interval_s)

    async def open(self, path: str, body: dict[str, Any], affinity: bytes | None, total_s: float) -> Opened:
        """Send ``body`` to the chosen replica and wait for its reply's head; the whole reply must be in
        within ``total_s`` of now. A connection error, or a 502, 503 or 504, before any byte of the reply
        is retried on another replica (each at most once); what failed after the head is never retried.

        Raises:
            UpstreamUnavailable: No replica answered, or this gateway's connections to the pool were all
                busy for the connect timeout.
        """
        deadline = asyncio.get_running_loop().time() + total_s
        tried: set[str] = set()
        while True:
            replica = self.replicas.pick(affinity, tried, time.monotonic())
            if replica is None:
                raise UpstreamUnavailable(f"no replica of {self.name!r} answered ({len(tried)} tried)")
            if tried:
                self.num_retries += 1
            tried.add(replica.url)
            replica.num_outstanding += 1
            replica.num_requests += 1
            response = await self._try(replica, path, body)
            if response is not None:
                return Opened(self, replica, response, deadline)

    async def _try(self, replica: Replica, path: str, body: dict[str, Any]) -> httpx.Response | None:
        request = self.client.build_request("POST", replica.url + path, json=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.PoolTimeout:  # this gateway's own connections were all taken: no fault of the replica
            replica.num_outstanding -= 1
            self.replicas.on_abandoned(replica)
            raise UpstreamUnavailable(f"every connection to {self.name!r} is busy") from None
        except httpx.TransportError as e:  # nothing came back: connecting, or the head, failed
            replica.num_outstanding -= 1
            self.fail(replica)
            if isinstance(e, httpx.ReadTimeout | httpx.WriteTimeout):  # it may be working on it: no retry
                raise UpstreamUnavailable(f"a replica of {self.name!r} timed out") from None
            log.warning("upstream.try_failed", model=self.name, url=replica.url,
                        error_type=type(e).__name__)
            return None
        if response.status_code in RETRY_STATUSES:
            await response.aclose()
            replica.num_outstanding -= 1
            if response.status_code in BUSY_STATUSES:
                self.replicas.on_abandoned(replica)
            else:
                self.fail(replica)
            log.warning("upstream.try_failed", model=self.name, url=replica.url,
                        status=response.status_code)
            return None
        return response
