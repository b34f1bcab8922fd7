"""Stopping without cutting requests short: on SIGTERM or SIGINT, ``kvgate serve`` drains first.

The server keeps listening while it drains, so a client that comes meanwhile gets a clear 503
``shutting_down`` instead of a refused connection, and ``/readyz`` turns 503 for the load balancer.
The requests in flight may finish for ``shutdown_grace_s``; whatever still runs then is ended (a
stream with a final error event, a whole request with the same 503) and settled. Then uvicorn shuts
down as usual and the process exits 0.
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

    async def _drain(self, signal_name: str) -> None:
        self.drain.begin()
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
