"""A real ``kvgate serve`` in a child process (uvicorn on uvloop, TLS, the process engine), for the tests
that are about what users run: load, streaming, slow peers, a dying engine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from .conftest import run_sync

KVGATE = [sys.executable, "-c", "from gateway.cli import app; app()"]
# The flags of the server test_served and test_faults_disconnects share (conftest's ``shared_server``): a
# fixed KV pool (the tiny model's blocks are small; the default sizes it by memory), no determinism mode
# whose kernels build at start-up, a short stall timeout for test_served's clients that stop reading, and
# room for test_faults_disconnects' hundreds of connections from one peer.
SHARED_SERVE_ARGS = ("--num-kv-blocks", "4096", "--determinism-modes", "fast",
                     "--stream-stall-timeout-s", "2", "--http-max-connections-per-peer", "256")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A running server: its base URL, CA, admin token, data dir, environment and process."""

    base: str
    ca: Path
    admin_token: str
    data_dir: Path
    env: dict[str, str]
    proc: subprocess.Popen

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, verify=str(self.ca), timeout=60,
                            headers={"Authorization": f"Bearer {self.admin_token}"})

    def make_tenant(self, name: str, policy: dict | None = None) -> tuple[str, str]:
        """A new tenant named ``name`` (with ``policy``, else the default one): its id and a key of it."""
        with self.admin() as admin:
            body = {"name": name} if policy is None else {"name": name, "policy": policy}
            r = admin.post("/admin/v1/tenants", json=body)
            assert r.status_code == 201, r.text
            tenant = r.json()
            key = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "k"}).json()["key"]
        return tenant["id"], key

    def make_key(self, name: str, policy: dict | None = None) -> str:
        """A key of a new tenant named ``name`` (with ``policy``)."""
        return self.make_tenant(name, policy)[1]

    def log(self, since: int = 0) -> str:
        """The server's output, from byte ``since`` on (a ``log_size()`` taken earlier: what a test on a
        shared server caused, not what the modules before it did)."""
        with open(self.data_dir / "serve.log", "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        return (self.data_dir / "serve.log").stat().st_size

    def engine_pid(self) -> int:
        """The engine child's pid (multiprocessing's spawned child, not its resource tracker)."""
        for child in psutil.Process(self.proc.pid).children():
            if any("spawn_main" in part for part in child.cmdline()):
                return child.pid
        raise AssertionError("no engine child")

    def ready(self) -> Served:
        """Wait until it serves, then give it an admin token."""
        self.wait_ready()
        self.admin_token = issue_admin_token(self.data_dir, self.env.get("KVGATE_DB_URL"))
        return self

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def wait_ready(self, timeout_s: float = 300.0) -> None:  # a first start may build C++ kernels
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log()
            if self.ca.exists():
                try:
                    r = httpx.get(f"{self.base}/readyz", verify=str(self.ca), timeout=2)
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)


def issue_admin_token(data_dir: Path, db_url: str | None = None) -> str:
    """An admin token with every scope in the served database, as ``kvgate admin bootstrap`` issues it
    but from this process: a CLI process of its own imports the gateway again, seconds of every start.
    (Unaudited, like the tests' other set-up changes; the bootstrap command is tested on its own.)"""
    from gateway.schemas.admin import ADMIN_SCOPES
    from gateway.secrets import Hasher, load_or_create_pepper
    from gateway.settings import Settings
    from gateway.storage.db import make_db_engine, make_sessionmaker
    from gateway.tenancy import keys

    url = Settings(data_dir=data_dir, db_url=db_url).database_url

    async def issue() -> str:
        db = make_db_engine(url, null_pool=True)
        try:
            async with make_sessionmaker(db)() as s:
                return await keys.create_admin_token(s, Hasher(load_or_create_pepper(data_dir)), "bootstrap",
                                                     ADMIN_SCOPES)
        finally:
            await db.dispose()

    return run_sync(issue)  # type: ignore[return-value]


def launch(data_dir: Path, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> Served:
    """Start ``kvgate serve --model model_dir *args`` on a free loopback port and return at once (``ready``
    waits for it); ``env`` adds to its environment (and the admin token's: ``KVGATE_DB_URL``, say)."""
    port = free_port()
    env = os.environ | {"KVGATE_DATA_DIR": str(data_dir), "KVGATE_LOG_JSON": "true"} | (env or {})
    with open(data_dir / "serve.log", "wb") as log:
        proc = subprocess.Popen([*KVGATE, "serve", "--port", str(port), "--model", str(model_dir), *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    return Served(f"https://127.0.0.1:{port}", data_dir / "tls" / "ca.pem", "", data_dir, env, proc)


@contextmanager
def serve(data_dir: Path, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """``launch``, ready and with an admin token, until the block ends."""
    served = launch(data_dir, model_dir, *args, env=env)
    try:
        yield served.ready()
    finally:
        served.stop()
