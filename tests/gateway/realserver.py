"""The real app under a real uvicorn on a loopback port, in a thread with its own event loop.

Litestar's ``AsyncTestClient`` runs one request at a time, so concurrency can only be tested here: real
connections, served as ``kvgate serve`` serves them, with each request's server-side span recorded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.cli.serve_cmds import uvicorn_options
from gateway.settings import Settings
from gateway.storage import migrate
from gateway.tenancy import keys
from policies import Policy

from .conftest import PG_HOST, PG_PORT, _create_pg_database, _drop_pg_database, run_sync

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0


class RequestSpans:
    """Wraps an ASGI app and records, for every ``/v1/`` request, when the app was called and when it
    was about to send the response's last byte (it may go on settling after that). A client that waits
    for each response before it sends the next request can never make two spans overlap."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.spans: list[tuple[float, float]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        start, end = time.monotonic(), None

        async def timed_send(message: Any) -> None:
            nonlocal end
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                end = time.monotonic()  # before the last byte leaves: no client can have seen it yet
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.spans.append((start, end or time.monotonic()))


def max_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant (one ending as another starts does not count as overlap)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


class RealServer:
    """One gateway instance: ``create_app(settings, engine=engine)`` served by uvicorn on 127.0.0.1."""

    def __init__(self, settings: Settings, engine: Any) -> None:
        self.recorder = RequestSpans(create_app(settings, engine=engine))
        options = uvicorn_options(settings) | {"host": "127.0.0.1", "port": 0}
        self._server = uvicorn.Server(uvicorn.Config(self.recorder, **options))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._server.serve(),),
                                        name="real-server", daemon=True)
        self.admin_token = ""

    @property
    def base_url(self) -> str:
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            assert self._thread.is_alive(), "the server stopped while starting"
            assert time.monotonic() < deadline, "the server did not start in time"
            time.sleep(0.02)
        runtime = self.recorder.app.state.runtime

        async def admin_token() -> str:
            async with runtime.sessionmaker() as s:
                return await keys.create_admin_token(s, runtime.hasher, "test")

        # on the server's own loop, where its database engine lives
        self.admin_token = asyncio.run_coroutine_threadsafe(admin_token(), self._loop).result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(START_TIMEOUT_S)
        self._loop.close()

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    async def make_tenant(self, policy: Policy) -> tuple[str, str]:
        """Create a tenant with ``policy`` and one key through the admin API; returns (tenant_id, key)."""
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.admin(), timeout=30) as client:
            r = await client.post("/admin/v1/tenants", json={"name": f"t{time.monotonic_ns()}",
                                                             "policy": policy.model_dump(mode="json")})
            assert r.status_code == 201, r.text
            tid = r.json()["id"]
            r = await client.post(f"/admin/v1/tenants/{tid}/keys", json={})
            assert r.status_code == 201, r.text
            return tid, r.json()["key"]


@contextmanager
def serve(settings: Settings, engine: Any) -> Iterator[RealServer]:
    server = RealServer(settings, engine)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextmanager
def migrated_db(kind: str, path: Path, pg_user: str | None) -> Iterator[str]:
    """A fresh, migrated database that outlives one test: SQLite under ``path``, or a throwaway
    PostgreSQL database (``pg_user`` connects)."""
    if kind == "sqlite":
        url = f"sqlite+aiosqlite:///{path / 'kvgate.db'}"
        run_sync(lambda: migrate.upgrade(url))
        yield url
        return
    assert pg_user is not None
    name = _create_pg_database(pg_user)
    url = f"postgresql+asyncpg://{pg_user}@{PG_HOST}:{PG_PORT}/{name}"
    try:
        run_sync(lambda: migrate.upgrade(url))
        yield url
    finally:
        _drop_pg_database(pg_user, name)
