"""A real ``kvgate serve`` whose SQLite database lies on a filesystem that fills up under load, then
gets room again: the requests that meet the full disk are refused with a 503 to retry later, none is
half-written, and once there is room the gateway serves on and settles what it could not before.

The small filesystem is a size-limited tmpfs mounted for the test: writes past its size fail with
ENOSPC, which SQLite reports as SQLITE_FULL, exactly as on a full disk, and deleting a file gives the
room back. (``RLIMIT_FSIZE`` would need no mount, but its EFBIG is an I/O error to SQLite, not a full
disk, and it limits every file the server writes, its log too.)"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from .faultload import SERVE_ARGS, chat, model_id, through_a_fault
from .ledger import check_answers, settled_ledgers
from .served import serve

pytestmark = pytest.mark.timeout(300)
NUM_WORKERS = 6
SIZE = "32m"


@pytest.fixture
def small_fs() -> Path:
    """A tmpfs of ``SIZE`` mounted on a fresh directory (skips where mounting is not permitted)."""
    root = Path(tempfile.mkdtemp(prefix="kvgate-small-fs-"))
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", str(root)],
                                 capture_output=True, text=True, check=False)
    except FileNotFoundError:
        mounted = None
    if mounted is None or mounted.returncode != 0:
        root.rmdir()
        why = "no mount command" if mounted is None else mounted.stderr.strip()
        pytest.skip(f"cannot mount a size-limited tmpfs here ({why}): the test needs a filesystem that fills")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _fill(root: Path) -> Path:
    """Write a file until the filesystem has no room left; returns it."""
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\xff" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_under_sqlite_is_503s_nothing_half_written_then_recovery(
        tmp_path, tiny_model_dir, small_fs: Path) -> None:
    """The filesystem is filled under load until the gateway has refused requests for it and every
    request under way when it filled has ended, then the filler is deleted."""
    url = f"sqlite:///{small_fs / 'kvgate.db'}"
    with serve(tmp_path, tiny_model_dir, *SERVE_ARGS, env={"KVGATE_DB_URL": url}) as server:
        tenants = [server.make_tenant(f"full-disk-{i}") for i in range(3)]
        keys = [key for _, key in tenants]
        body = chat(model_id(server, keys[0]), max_tokens=16, ignore_eos=True)
        load, full = asyncio.run(through_a_fault(server, keys, body, NUM_WORKERS, "database_full",
                                              lambda: _fill(small_fs), (small_fs / "filler").unlink))
        ledgers = settled_ledgers(url, tmp_path, [tid for tid, _ in tenants])
        assert "request.unhandled" not in server.log()
    # Requests under way when the disk filled were answered, and settled once there was room.
    assert any(o.is_ok and o.started < full < o.ended for o in load.outcomes)
    check_answers(ledgers, {o.request_id: o.usage for o in load.outcomes if o.is_ok})
