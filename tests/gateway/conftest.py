"""Gateway fixtures: one tiny real engine per session, a migrated database per test (SQLite or PostgreSQL)."""

from __future__ import annotations

import asyncio
import inspect
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio
from litestar.testing import AsyncTestClient
from sqlalchemy import text

from gateway.app import create_app
from gateway.audit_hook import AuditHook
from gateway.settings import Settings
from gateway.storage import migrate
from gateway.storage.db import make_db_engine
from gateway.storage.txn import TxnRunner
from gateway.tenancy import keys, tenants
from gateway.tenancy.admin_audit import AdminActor
from policies import Policy

if TYPE_CHECKING:
    from .served import Served

PG_HOST = os.environ.get("KVGATE_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("KVGATE_TEST_PG_PORT", "5432"))
PG_USERS = ("postgres", "root")
# The author of set-up changes (a test's tenants and keys, not its subject): their events go nowhere, so
# the audit trail and the logs hold only what the test itself does.
SETUP = AdminActor(AuditHook(lambda name, fields: None), "test")


def run_sync(coro_fn: Callable[[], object]) -> object:
    """Run a coroutine to completion on a private loop in a thread (safe from inside pytest-asyncio)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def _pg_user() -> str | None:
    import asyncpg

    async def probe() -> str | None:
        for user in PG_USERS:
            try:
                conn = await asyncpg.connect(
                    host=PG_HOST, port=PG_PORT, user=user, database="postgres", timeout=3
                )
            except Exception:  # noqa: BLE001
                continue
            await conn.close()
            return user
        return None

    return run_sync(probe)  # type: ignore[return-value]


@pytest.fixture(scope="session")
def pg_user() -> str | None:
    user = _pg_user()
    if user is None and os.environ.get("CI"):
        pytest.fail(f"CI is set but no PostgreSQL server answers at {PG_HOST}:{PG_PORT}")
    return user


def _create_pg_database(user: str) -> str:
    import asyncpg

    name = f"kvgate_test_{secrets.token_hex(6)}"

    async def create() -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=user, database="postgres")
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()

    run_sync(create)
    return name


def _drop_pg_database(user: str, name: str) -> None:
    import asyncpg

    async def drop() -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=user, database="postgres")
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()

    run_sync(drop)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> object:
    """A fresh, migrated database: SQLite in tmp_path, or a throwaway PostgreSQL database."""
    if request.param == "sqlite":
        yield migrated_sqlite(tmp_path)
        return
    user = request.getfixturevalue("pg_user")
    if user is None:
        pytest.skip(f"no PostgreSQL server answers at {PG_HOST}:{PG_PORT} (set CI=1 to make this a failure)")
    name = _create_pg_database(user)
    url = f"postgresql+asyncpg://{user}@{PG_HOST}:{PG_PORT}/{name}"
    try:
        run_sync(lambda: migrate.upgrade(url))
        yield url
    finally:
        _drop_pg_database(user, name)


def migrated_sqlite(path: Path) -> str:
    """The URL of a new SQLite database in ``path``, migrated to head."""
    url = f"sqlite+aiosqlite:///{path / 'kvgate.db'}"
    run_sync(lambda: migrate.upgrade(url))
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return migrated_sqlite(tmp_path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


# The default model's server that the real-client modules share: the fast mode alone (batch_invariant's
# start-up proof of its kernels is most of a start) and a small KV pool.
DEFAULT_SERVER_ARGS = ("--num-kv-blocks", "1024", "--determinism-modes", "fast")


@pytest.fixture(scope="session")
def shared_default_server(tmp_path_factory: pytest.TempPathFactory,
                          default_model_dir: Path) -> Iterator[Served]:
    """One ``kvgate serve`` of the default model (``DEFAULT_SERVER_ARGS``) for the modules that run real
    clients against it, started by the first that asks (a start costs tens of seconds); each makes its
    own tenants, under names of its own."""
    from .served import serve

    with serve(tmp_path_factory.mktemp("default-serve"), default_model_dir, *DEFAULT_SERVER_ARGS) as served:
        yield served


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory,
                  tiny_model_dir: Path) -> Iterator[Callable[..., Served]]:
    """``shared_server(*args)``: a ``kvgate serve`` of the tiny model with ``args``, started by the first
    module that asks and kept for every later one with the same ``args`` (a start costs tens of seconds).
    For tests that leave it serving and need no fresh one: unique tenant names, their own counters."""
    from .served import serve

    with ExitStack() as stack:
        servers: dict[tuple[str, ...], Served] = {}

        def get(*args: str) -> Served:
            if args not in servers:
                data_dir = tmp_path_factory.mktemp("shared-serve")
                servers[args] = stack.enter_context(serve(data_dir, tiny_model_dir, *args))
            return servers[args]

        yield get


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """The gateway's tests run on uvloop, as ``kvgate serve`` (uvicorn) does (pytest-asyncio's hook; its
    ``event_loop_policy`` fixture, which did this before, is deprecated)."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every coroutine test here checks its loop (``_on_uvloop``): a loop set up some other way would
    otherwise go unnoticed, the tests passing on asyncio's own loop."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and inspect.iscoroutinefunction(getattr(item, "obj", None)):
            item.fixturenames.append("_on_uvloop")


@pytest.fixture
async def _on_uvloop() -> None:
    import uvloop

    loop = asyncio.get_running_loop()
    assert isinstance(loop, uvloop.Loop), f"an in-process gateway test runs on {type(loop)}, not uvloop"


@pytest.fixture(scope="session")
def llm(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """The engine as ``kvgate serve`` runs it: a child process (``ProcessLLMEngine``).

    One engine serves the whole session while every test runs on a loop of its own, so here a reader
    thread takes the child's outputs; the event loop's own reader, which ``kvgate serve`` uses, is tested
    by tests/engine/test_process_uvloop.py and by the real servers of tests/gateway/test_served.py.
    """
    from engine import EngineConfig
    from engine.front.process import ProcessLLMEngine

    engine = ProcessLLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            num_kv_blocks=256,
            max_num_seqs=Settings(data_dir=tiny_model_dir).max_num_seqs,  # part of fixed mode's fingerprint
            scheduling_policy=Settings(data_dir=tiny_model_dir).scheduling_policy,
            # As `kvgate serve` and `kvgate replay` pin them (one core kept for the gateway): torch's
            # thread count is process-wide, and part of the system fingerprint a replay compares.
            num_threads=Settings(data_dir=tiny_model_dir).engine_threads,
        )
    )
    engine.start()  # no running loop here: the reader thread
    yield engine
    engine.shutdown()


@dataclass
class Gateway:
    """A running app plus handles tests need: its client, runtime and an admin token."""

    client: AsyncTestClient
    admin_token: str
    settings: Settings

    @property
    def runtime(self):  # type: ignore[no-untyped-def]
        return self.client.app.state.runtime

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    async def make_tenant(self, name: str | None = None, policy: Policy | None = None) -> tuple[str, str]:
        """Create a tenant (+ policy) and one key directly through the services; returns (tenant_id, key)."""
        rt = self.runtime
        async with rt.sessionmaker() as s:
            t = await tenants.create_tenant(s, SETUP, name or f"t-{secrets.token_hex(4)}", policy or Policy())
        async with rt.sessionmaker() as s:
            created = await keys.create_key(s, rt.hasher, SETUP, t.id, "k", None)
        return t.id, created.key


def make_settings(tmp_path: Path, db_url: str, **overrides: object) -> Settings:
    return Settings(data_dir=tmp_path, db_url=db_url, insecure_http=True, db_null_pool=True, **overrides)


async def open_gateway(
    tmp_path: Path, db_url: str, llm: object, **overrides: object
) -> AsyncIterator[Gateway]:
    settings = make_settings(tmp_path, db_url, **overrides)
    app = create_app(settings, engine=llm)
    async with AsyncTestClient(app, timeout=60) as client:
        rt = app.state.runtime
        async with rt.sessionmaker() as s:
            token = await keys.create_admin_token(s, rt.hasher, "test")
        yield Gateway(client, token, settings)


@pytest.fixture
async def gw(tmp_path: Path, sqlite_url: str, llm: object) -> AsyncIterator[Gateway]:
    async for g in open_gateway(tmp_path, sqlite_url, llm):
        yield g


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mgw(tmp_path_factory: pytest.TempPathFactory, llm: object) -> AsyncIterator[Gateway]:
    """One gateway for the module, on the module's loop (its tests marked
    ``pytest.mark.asyncio(loop_scope="module")``), for tests that each ask as a new tenant and need no
    fresh database: a migration and an app start once, not per test."""
    data_dir = tmp_path_factory.mktemp("module-gateway")
    async for g in open_gateway(data_dir, migrated_sqlite(data_dir), llm):
        yield g


@pytest.fixture
def restore_logging() -> object:
    """Put back the root logger, the loggers configure_logging touches, and structlog's defaults."""
    import logging

    import structlog

    from audit.logging import ROUTED_LOGGERS

    names = ("", "sqlalchemy.engine", *ROUTED_LOGGERS)
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level) for n in names}
    yield
    for name, (handlers, level) in saved.items():
        logging.getLogger(name).handlers[:] = handlers
        logging.getLogger(name).setLevel(level)
    structlog.reset_defaults()


async def tenant_events(db_url: str, data_dir: Path, tenant_id: str) -> list[tuple[str, str | None, dict]]:
    """``(name, request_id, data)`` of a tenant's audit events in chain order; the chain must verify.

    The app runs on the test client's own loop, so this reads through an engine of the caller's loop.
    """
    import json

    from sqlalchemy import select

    from audit.integrity import verify_store
    from audit.keys import load_or_create_keys
    from audit.store import AuditStore
    from audit.tables import audit_events
    from gateway.storage.db import make_db_engine

    store = AuditStore(make_db_engine(db_url, null_pool=True), load_or_create_keys(data_dir))
    try:
        async with store.engine.connect() as conn:
            rows = (await conn.execute(
                select(audit_events.c.name, audit_events.c.request_id, audit_events.c.data)
                .where(audit_events.c.tenant_id == tenant_id)
                .order_by(audit_events.c.seq)
            )).all()
        assert (await verify_store(store)).ok
    finally:
        await store.engine.dispose()
    return [(name, request_id, json.loads(data)) for name, request_id, data in rows]


def add_token(conn: object, token_id: str, delay_s: float = 0.0) -> str:
    """A transaction body for the runner tests: insert an admin-token row (then hold the transaction)."""
    import time

    from sqlalchemy import insert

    from gateway.clock import utcnow
    from gateway.storage.models import AdminToken

    conn.execute(insert(AdminToken.__table__).values(  # type: ignore[attr-defined]
        id=token_id, name="", secret_hash="0" * 64, created_at=utcnow()))
    time.sleep(delay_s)
    return token_id


async def token_ids(db: object) -> set[str]:
    """The admin-token ids committed in ``db`` (an async engine)."""
    from sqlalchemy import select

    from gateway.storage.models import AdminToken

    async with db.connect() as conn:  # type: ignore[attr-defined]
        return set((await conn.execute(select(AdminToken.__table__.c.id))).scalars())


@asynccontextmanager
async def open_runner(url: str, **kwargs: object) -> AsyncIterator[tuple[object, TxnRunner]]:
    """An async engine on ``url`` and a ``TxnRunner`` over it, both closed on exit."""
    db = make_db_engine(url, null_pool=True)
    runner = TxnRunner(db, **kwargs)  # type: ignore[arg-type]
    try:
        yield db, runner
    finally:
        await runner.close()
        await db.dispose()


async def backend_pid(engine: object) -> int:
    """The PostgreSQL backend serving the connection ``engine``'s pool hands out next."""
    async with engine.begin() as conn:  # type: ignore[attr-defined]
        return (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()


async def terminate_backend(url: str, pid: int) -> None:
    """End PostgreSQL backend ``pid`` from a connection of its own, as a server restart would."""
    other = make_db_engine(url)
    try:
        async with other.begin() as conn:
            assert (await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})).scalar_one()
    finally:
        await other.dispose()
