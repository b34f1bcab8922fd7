"""Gateway benchmark fixtures: a migrated data dir with one tenant key, and `kvgate serve` subprocesses."""

from __future__ import annotations

import os
import secrets
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import gateway
from gateway.audit_hook import AuditHook
from gateway.secrets import Hasher, load_or_create_pepper
from gateway.settings import Settings
from gateway.storage import migrate
from gateway.storage.db import make_db_engine, make_sessionmaker
from gateway.tenancy import keys, tenants
from gateway.tenancy.admin_audit import AdminActor
from policies import Policy

ROOT = Path(gateway.__file__).resolve().parents[1]
# Every limit is set (so admission runs every conditional UPDATE it runs in production) but never reached.
BENCH_POLICY = Policy(
    requests_per_minute=10_000_000,
    tokens_per_minute=10**12,
    max_concurrent_requests=1000,
    daily_token_quota=10**13,
    monthly_token_quota=10**14,
)


@dataclass(frozen=True, slots=True)
class ServerVariant:
    """One way to start the gateway: ``insecure_http`` drops TLS; ``audit`` off logs events instead;
    ``durable`` off commits admissions without waiting for the disk; ``root``, another kvgate checkout
    whose code serves (an earlier commit, to compare with), sharing this one's data dir and database."""

    name: str
    insecure_http: bool = False
    audit: bool = True
    durable: bool = True
    root: Path = ROOT
    env: tuple[tuple[str, str], ...] = ()  # more KVGATE_* settings for the server


async def create_tenant_key(settings: Settings) -> tuple[str, str]:
    """Migrate ``settings``' database and create a tenant with ``BENCH_POLICY`` and one key.

    Returns:
        ``(tenant_id, api_key)``.
    """
    await migrate.upgrade(settings.database_url)
    db = make_db_engine(settings.database_url)
    hasher = Hasher(load_or_create_pepper(settings.data_dir))
    by = AdminActor(AuditHook(lambda name, fields: None), "bench")  # set-up, not measured: no events
    try:
        async with make_sessionmaker(db)() as s:
            t = await tenants.create_tenant(s, by, f"bench-{secrets.token_hex(4)}", BENCH_POLICY)
        async with make_sessionmaker(db)() as s:
            created = await keys.create_key(s, hasher, by, t.id, "bench", None)
    finally:
        await db.dispose()
    return t.id, created.key


def checkout_commit(root: Path) -> str | None:
    """``git describe --always --dirty`` of a checkout (``None`` when git cannot tell)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_argv(settings: Settings, variant: ServerVariant, port: int) -> list[str]:
    argv = [sys.executable, "-c", "from gateway.cli import app; app()", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--data-dir", str(settings.data_dir), "--max-num-seqs",
            str(settings.max_num_seqs), "--dtype", settings.dtype, "--device", settings.device]
    if settings.model:
        argv += ["--model", settings.model]
    if settings.db_url:
        argv += ["--db-url", settings.db_url]
    if settings.num_kv_blocks:
        argv += ["--num-kv-blocks", str(settings.num_kv_blocks)]
    return argv + (["--insecure-http"] if variant.insecure_http else [])


class GatewayServer:
    """``kvgate serve`` in a subprocess (the variant's checkout), ready once ``/readyz`` answers 200."""

    def __init__(self, settings: Settings, variant: ServerVariant) -> None:
        self.variant = variant
        self.port = free_port()
        scheme = "http" if variant.insecure_http else "https"
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self.ca = settings.data_dir / "tls" / "ca.pem"
        self.log_path = settings.data_dir / f"serve-{variant.name}.log"
        env = os.environ | {"PYTHONPATH": os.pathsep.join(
            p for p in (str(variant.root), os.environ.get("PYTHONPATH", "")) if p)}
        env["KVGATE_AUDIT_ENABLED"] = "true" if variant.audit else "false"
        env["KVGATE_DURABLE_COMMITS"] = "true" if variant.durable else "false"
        env.update(variant.env)
        self._argv, self._env = _serve_argv(settings, variant, self.port), env
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What an httpx client needs to trust this server (its generated CA)."""
        return False if self.variant.insecure_http else ssl.create_default_context(cafile=str(self.ca))

    def start(self, timeout_s: float = 180.0) -> GatewayServer:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> GatewayServer:
        """Start the process and return at once (``wait_ready`` waits for it): servers launched together
        start together, each start being mostly imports and model loading on a core of its own."""
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self._argv, env=self._env, cwd=self.variant.root, stdout=log,
                                          stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> GatewayServer:
        """Wait until ``/readyz`` answers 200; stops the server and raises RuntimeError if it exits first
        or ``timeout_s`` passes."""
        assert self._proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while not self._is_ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway {self.variant.name} did not start:\n{self.log_tail()}")
            time.sleep(0.3)
        return self

    def _is_ready(self) -> bool:
        if not self.variant.insecure_http and not self.ca.exists():
            return False
        try:
            return httpx.get(f"{self.base_url}/readyz", verify=self.verify, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
