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

KVGATE = [sys.executable, "-c", "from gateway.cli import app; app()"]


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

    def make_tenant(self, name: str) -> tuple[str, str]:
        """A new tenant named ``name``: its id and a key of it."""
        with self.admin() as admin:
            r = admin.post("/admin/v1/tenants", json={"name": name})
            assert r.status_code == 201, r.text
            tenant = r.json()
            key = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "k"}).json()["key"]
        return tenant["id"], key

    def make_key(self, name: str) -> str:
        """A key of a new tenant named ``name``."""
        return self.make_tenant(name)[1]

    def log(self) -> str:
        return (self.data_dir / "serve.log").read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine child's pid (multiprocessing's spawned child, not its resource tracker)."""
        for child in psutil.Process(self.proc.pid).children():
            if any("spawn_main" in part for part in child.cmdline()):
                return child.pid
        raise AssertionError("no engine child")

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


@contextmanager
def serve(data_dir: Path, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """``kvgate serve --model model_dir *args`` on a free loopback port, bootstrapped, until the block
    ends; ``env`` adds to its environment (and the bootstrap's: ``KVGATE_DB_URL``, say)."""
    port = free_port()
    env = os.environ | {"KVGATE_DATA_DIR": str(data_dir), "KVGATE_LOG_JSON": "true"} | (env or {})
    with open(data_dir / "serve.log", "wb") as log:
        proc = subprocess.Popen([*KVGATE, "serve", "--port", str(port), "--model", str(model_dir), *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        served = Served(f"https://127.0.0.1:{port}", data_dir / "tls" / "ca.pem", "", data_dir, env, proc)
        try:
            served.wait_ready()
            served.admin_token = subprocess.run([*KVGATE, "admin", "bootstrap"], env=env, check=True,
                                                capture_output=True, text=True).stdout.strip()
            yield served
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
