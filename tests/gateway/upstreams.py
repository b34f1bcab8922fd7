"""Real upstream servers for the upstream-pool tests: ``kvgate serve --insecure-http`` processes, started
together, each with a tenant for the front gateway whose key may send ``cache_salt``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.gateway.conftest import migrated_sqlite
from tests.gateway.served import KVGATE, free_port, issue_admin_token

# The suite's upstreams listen on loopback, which routes may reach only where the gateway allows private
# addresses (``make serve`` does not): a gateway routing to them is opened with these settings.
LOOPBACK = {"upstream_allow_private_addresses": True}


@dataclass
class Upstream:
    """One ``kvgate serve --insecure-http`` of a fleet sharing a database and data directory (so one key
    works on every replica, as behind a load balancer): its base URL and process."""

    base: str
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the server and its engine child at once, as a lost machine would go."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def wait_ready(self, deadline: float) -> None:
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def num_requests(self, admin_token: str, tenant_id: str) -> int:
        """Requests this process answered for ``tenant_id`` (its own metrics, not the shared database)."""
        text = httpx.get(f"{self.base}/metrics", headers={"Authorization": f"Bearer {admin_token}"}).text
        prefix = f'kvgate_requests_total{{endpoint="chat",status="ok",tenant="{tenant_id}"}}'
        return sum(int(float(line.split()[-1])) for line in text.splitlines() if line.startswith(prefix))


@dataclass
class Fleet:
    """The upstream servers, an admin token of theirs, and the front gateway's tenant and key there."""

    replicas: list[Upstream]
    admin_token: str
    front_tenant: str
    front_key: str

    def num_requests(self) -> list[int]:
        return [u.num_requests(self.admin_token, self.front_tenant) for u in self.replicas]


def _start(data_dir: Path, model_dir: Path, env: dict[str, str], i: int) -> Upstream:
    port = free_port()
    log_path = data_dir / f"serve{i}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*KVGATE, "serve", "--insecure-http", "--port", str(port), "--model", str(model_dir),
             "--dtype", "float32", "--num-kv-blocks", "512", "--engine-thread",
             "--determinism-modes", "fast"],  # no kernels to prove at start-up
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Upstream(f"http://127.0.0.1:{port}", log_path, proc)


def _set_up_front(base: str, data_dir: Path) -> tuple[str, str, str]:
    """An admin token, and a tenant for the front gateway whose policy trusts its salts, with a key."""
    token = issue_admin_token(data_dir)
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {token}"}) as admin:
        r = admin.post("/admin/v1/tenants", json={"name": "front", "policy": {"trust_cache_salt": True}})
        assert r.status_code == 201, r.text
        tenant = r.json()["id"]
        key = admin.post(f"/admin/v1/tenants/{tenant}/keys", json={"name": "front"}).json()["key"]
    return token, tenant, key


@contextmanager
def upstreams(root: Path, model_dir: Path, count: int, timeout_s: float = 300.0) -> Iterator[Fleet]:
    """``count`` upstream servers of ``model_dir`` on one migrated database, started at once and ready,
    until the block ends."""
    data_dir = root / "fleet"
    data_dir.mkdir(mode=0o700)
    env = os.environ | {"KVGATE_DATA_DIR": str(data_dir), "KVGATE_LOG_JSON": "true"}
    # Migrated before the servers start at once (each would migrate on start), from this process: a
    # `kvgate db upgrade` process would import the gateway again, seconds of the fleet's start.
    migrated_sqlite(data_dir)
    with ExitStack() as stack:
        replicas = []
        for i in range(count):
            up = _start(data_dir, model_dir, env, i)
            stack.callback(_stop, up)
            replicas.append(up)
        deadline = time.monotonic() + timeout_s
        for up in replicas:
            up.wait_ready(deadline)
        yield Fleet(replicas, *_set_up_front(replicas[0].base, data_dir))


def _stop(up: Upstream) -> None:
    if up.proc.poll() is not None:
        return
    up.proc.terminate()
    try:
        up.proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(up.proc.pid, signal.SIGKILL)
        up.proc.wait()
