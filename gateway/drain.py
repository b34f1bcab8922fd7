"""Stopping without cutting requests short: on SIGTERM or SIGINT, ``kvgate serve`` drains first.

The server keeps listening while it drains, so a client that comes meanwhile gets a clear 503
``shutting_down`` instead of a refused connection, and ``/readyz`` turns 503 for the load balancer.
The requests in flight may finish for ``shutdown_grace_s``; whatever still runs then is ended (a
stream with a final error event, a whole request with the same 503) and settled. Then uvicorn shuts
down, without waiting for idle clients to answer a TLS close (``DrainingServer.shutdown``), and the
process exits 0. The engine child is not replaced if it dies once the drain has begun, and is stopped
once, by the lifespan's end.
"""

from __future__ import annotations

import asyncio
import json
import signal
from types import FrameType
from typing import Any

import structlog
import uvicorn
from litestar.types import Receive, Scope, Send

from gateway.errors import error_body

log = structlog.get_logger()
RETRY_AFTER_S = 5  # about the time a replacement process takes to serve
CLOSE_NOTIFY_S = 0.1  # what idle connections get to take their TLS close before they are cut
# After the grace period, how long the requests just ended may take to be settled and answered.
SETTLE_AFTER_GRACE_S = 10.0
_ALWAYS_OPEN = ("/healthz",)  # liveness: the process still answers
_REFUSAL = json.dumps(error_body("The server is shutting down; retry the request.", "server_error",
                                 "shutting_down")).encode()
_NOT_READY = json.dumps({"status": "shutting_down", "checks": {}}).encode()


class Drain:
    """ASGI wrapper of the app: counts the HTTP requests in flight and, once ``begin`` was called,
    answers every new one with 503 ``shutting_down`` (``/readyz`` too; ``/healthz`` still 200)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.is_draining and scope["path"] not in _ALWAYS_OPEN:
            return await _refuse(scope, send)
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1
            if self.is_draining and self.num_in_flight == 0:
                self._idle.set()

    def begin(self) -> None:
        """Refuse new requests from now on."""
        self.is_draining = True
        if self.num_in_flight == 0:
            self._idle.set()

    async def until_idle(self, timeout_s: float) -> bool:
        """Whether every request in flight ended within ``timeout_s``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return self.num_in_flight == 0
        return True


async def _refuse(scope: Scope, send: Send) -> None:
    body = _NOT_READY if scope["path"] == "/readyz" else _REFUSAL
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or SIGINT (see the module docstring); a second
    one ends the grace period at once, a third stops without settling anything more. It does not re-raise
    the signal once stopped (uvicorn does, which made the process die of it instead of exiting 0)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, runtime: Any, grace_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.runtime = runtime
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._cut_short = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if loop is None or not self.started:  # still starting: stop as uvicorn would, without draining
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain(name))
        elif not self._cut_short.is_set():
            self._cut_short.set()
        else:  # a third: stop at once, as uvicorn's forced exit does (nothing more is settled)
            self.force_exit = self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        """uvicorn's shutdown, once idle connections are closed. uvicorn closes them and then waits
        (up to its graceful timeout, 5 s) until they are gone, but a TLS connection is gone only once
        the client has answered the close (uvloop waits up to 30 s for it), and an idle client in a
        connection pool may never read it: those are cut after ``CLOSE_NOTIFY_S``. The drain has
        ended every request by now; a reply still being written keeps its connection."""
        for server in self.servers:
            server.close()  # no new connection meanwhile
        idle = [c for c in self.server_state.connections if _is_idle(c)]
        for connection in idle:
            connection.shutdown()  # a TLS connection sends its close_notify
        await asyncio.sleep(CLOSE_NOTIFY_S)
        for connection in idle:
            if connection in self.server_state.connections:
                connection.transport.abort()
        await super().shutdown(sockets)

    async def _drain(self, signal_name: str) -> None:
        self.drain.begin()
        _stop_restarting(self.runtime)
        log.info("shutdown.draining", signal=signal_name, num_in_flight=self.drain.num_in_flight,
                 grace_s=self.grace_s)
        cut_short = asyncio.ensure_future(self._cut_short.wait())
        idle = asyncio.ensure_future(self.drain.until_idle(self.grace_s))
        await asyncio.wait([idle, cut_short], return_when=asyncio.FIRST_COMPLETED)
        cut_short.cancel()
        if not (idle.done() and idle.result()):
            idle.cancel()
            log.warning("shutdown.grace_over", num_in_flight=self.drain.num_in_flight)
            await self.runtime.end_in_flight()
            await self.drain.until_idle(SETTLE_AFTER_GRACE_S)
        log.info("shutdown.drained", num_in_flight=self.drain.num_in_flight)
        self.should_exit = True


def _is_idle(connection: Any) -> bool:
    """Whether an HTTP connection is between requests (uvicorn's own test in its ``shutdown``)."""
    cycle = getattr(connection, "cycle", None)
    return cycle is None or cycle.response_complete


def _stop_restarting(runtime: Any) -> None:
    """From the drain on, an engine child that dies is not replaced: nothing new will be served, and a
    replacement would still be loading when the server exits."""
    from engine.front.process import ProcessLLMEngine

    if runtime.owns_engine and isinstance(runtime.engine, ProcessLLMEngine):
        runtime.engine.stop_restarting()
