"""One upstream pool's connections: health checks, and sending a request with retries before its first
byte, per-upstream timeouts and circuit breakers."""

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
from gateway.upstream.pool import Replica, ReplicaSet

log = structlog.get_logger()
HEALTH_PATHS = {"vllm": "/health", "sglang": "/health", "llamacpp": "/health", "kvgate": "/readyz",
                "openai-compatible": "/v1/models"}
# Replies that say "not this replica, not now": the request did no work there, so another may take it.
RETRY_STATUSES = frozenset({502, 503, 504})


class UpstreamUnavailable(Exception):
    """No replica of the pool could take the request (all down, open, or failing before a byte)."""


@dataclass
class Opened:
    """A reply whose head has come from ``replica``; ``close`` ends it and tells the breaker how it went."""

    pool: UpstreamPool
    replica: Replica
    response: httpx.Response
    _is_closed: bool = field(default=False, init=False)

    async def chunks(self) -> AsyncIterator[str]:
        """The body's lines, each within the pool's idle timeout of the one before."""
        lines = self.response.aiter_lines()
        while True:
            try:
                async with asyncio.timeout(self.pool.route.timeouts.idle_s):
                    line = await anext(lines)
            except StopAsyncIteration:
                return
            yield line

    async def close(self, *, is_ok: bool | None) -> None:
        """End the reply: ``is_ok`` tells the breaker how the replica did (``None``: nothing to tell, the
        client left)."""
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

    def __init__(self, name: str, version: int, route: UpstreamRoute, api_key: str | None) -> None:
        self.name, self.version, self.route = name, version, route
        self.replicas = ReplicaSet(route.urls, slack=route.affinity_slack,
                                   failures_to_open=route.failures_to_open, open_s=route.open_s)
        t = route.timeouts
        limits = httpx.Limits(max_connections=route.max_connections * len(route.urls),
                              max_keepalive_connections=route.max_connections * len(route.urls))
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.client = httpx.AsyncClient(
            headers=headers, limits=limits, trust_env=False,
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
            if replica.is_healthy != is_healthy:
                log.info("upstream.health", model=self.name, url=replica.url, is_healthy=is_healthy)
            replica.is_healthy = is_healthy

    async def _is_healthy(self, url: str, deadline: float) -> bool:
        try:
            async with asyncio.timeout(deadline):
                r = await self.client.get(url)
        except (httpx.HTTPError, TimeoutError):
            return False
        return r.status_code == 200

    async def _check_health_forever(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.route.health_interval_s)

    async def open(self, path: str, body: dict[str, Any], affinity: bytes | None) -> Opened:
        """Send ``body`` to the chosen replica and wait for its reply's head. A connection error, or a 502,
        503 or 504, before any byte of the reply is retried on another replica (each at most once); what
        failed after the head is never retried here.

        Raises:
            UpstreamUnavailable: No replica answered.
        """
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
            opened = await self._try(replica, path, body)
            if opened is not None:
                return opened

    async def _try(self, replica: Replica, path: str, body: dict[str, Any]) -> Opened | None:
        request = self.client.build_request("POST", replica.url + path, json=body)
        try:
            response = await self.client.send(request, stream=True)
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
            self.fail(replica)
            log.warning("upstream.try_failed", model=self.name, url=replica.url,
                        status=response.status_code)
            return None
        return Opened(self, replica, response)
