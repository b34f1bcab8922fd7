"""A PostgreSQL server of the test's own (initdb in a temp dir, a free loopback port), which a test may
stop, start and restart under load without touching any server that others use."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .served import free_port

# initdb and pg_ctl refuse to run as root: as root, they run as this user.
PG_OS_USER = "postgres"


def pg_bin_dir() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``: ``KVGATE_TEST_PG_BIN``, the newest Debian-style
    ``/usr/lib/postgresql/*/bin``, or ``PATH``; ``None`` when there are none."""
    candidates = [os.environ.get("KVGATE_TEST_PG_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]),
                         reverse=True)
    which = shutil.which("initdb")
    candidates.append(str(Path(which).parent) if which else "")
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


def missing_reason() -> str | None:
    """Why no private server can be run here, or ``None`` when one can."""
    if pg_bin_dir() is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl) here; KVGATE_TEST_PG_BIN names their directory"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_OS_USER)
        except KeyError:
            return f"initdb refuses to run as root, and there is no '{PG_OS_USER}' user to run it as"
    return None


class PrivatePostgres:
    """One server: its data directory under ``root``, listening on 127.0.0.1:``port`` only."""

    def __init__(self, bin_dir: Path, root: Path) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.port = free_port()
        self.data = root / "data"

    @property
    def url(self) -> str:
        return f"postgresql://{PG_OS_USER}@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str, timeout_s: float = 60.0) -> None:
        command = [str(self.bin_dir / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", PG_OS_USER, "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=timeout_s)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", PG_OS_USER, "-E", "UTF8", "--no-sync")

    def _options(self) -> str:
        return f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"

    def start(self) -> None:
        """Start it and wait until it accepts connections."""
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options(), "-l", str(self.root / "log"), "-w",
                  "-t", "60", "start")

    def stop(self, mode: str = "fast", *, wait: bool = True) -> None:
        """Shut down: ``fast`` ends sessions, rolling back open transactions; ``smart`` waits for them to
        end, refusing new ones meanwhile. ``wait=False`` returns once the server was told."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w" if wait else "-W", "-t", "60", "stop")

    def log(self) -> str:
        path = self.root / "log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A started private server, stopped and deleted at the end (the caller checked ``missing_reason``)."""
    bin_dir = pg_bin_dir()
    assert bin_dir is not None
    root = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
    if os.geteuid() == 0:  # the server's user must own its directory (root's temp dirs are 0700)
        entry = pwd.getpwnam(PG_OS_USER)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    server = PrivatePostgres(bin_dir, root)
    try:
        server.init()
        server.start()
        yield server
    finally:
        try:
            server.stop()
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(root, ignore_errors=True)
