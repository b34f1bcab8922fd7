"""Secrets on disk: private modes, no following of planted links, and no half-written secret after a crash."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import secrets as kv_secrets
from gateway.secrets import load_or_create_pepper
from gateway.tls import ensure_tls


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_new_data_dir_and_its_secrets_are_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "a" / "data"
    assert len(load_or_create_pepper(data_dir)) == 32
    files = ensure_tls(data_dir)
    assert _mode(data_dir) == 0o700 and _mode(data_dir / "tls") == 0o700
    assert _mode(data_dir / "pepper") == 0o600
    assert _mode(files.key) == 0o600 and _mode(data_dir / "tls" / "ca.key") == 0o600
    assert load_or_create_pepper(data_dir) == (data_dir / "pepper").read_bytes()  # read back, not remade


def test_loose_modes_left_by_an_older_version_are_tightened(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    pepper = load_or_create_pepper(data_dir)
    files = ensure_tls(data_dir)
    for path, mode in [(data_dir, 0o755), (data_dir / "tls", 0o755), (data_dir / "pepper", 0o644),
                       (files.key, 0o644), (data_dir / "tls" / "ca.key", 0o640)]:
        path.chmod(mode)
    assert load_or_create_pepper(data_dir) == pepper
    assert ensure_tls(data_dir).key == files.key
    assert [_mode(p) for p in (data_dir, data_dir / "tls")] == [0o700, 0o700]
    assert [_mode(p) for p in (data_dir / "pepper", files.key, data_dir / "tls" / "ca.key")] == [0o600] * 3


def test_a_link_planted_at_the_pepper_path_is_not_followed(tmp_path: Path) -> None:
    data_dir, planted = tmp_path / "data", tmp_path / "attacker-pepper"
    data_dir.mkdir(mode=0o700)
    planted.write_bytes(b"k" * 32)  # a pepper the planter knows
    (data_dir / "pepper").symlink_to(planted)
    with pytest.raises(kv_secrets.UnsafeSecretPath, match="symbolic link"):
        load_or_create_pepper(data_dir)
    (data_dir / "pepper").unlink()
    (data_dir / "pepper").symlink_to(tmp_path / "nowhere")  # dangling: not created through the link either
    with pytest.raises(kv_secrets.UnsafeSecretPath, match="symbolic link"):
        load_or_create_pepper(data_dir)
    assert not (tmp_path / "nowhere").exists() and planted.read_bytes() == b"k" * 32


def test_a_link_planted_at_a_tls_key_path_is_not_written_through(tmp_path: Path) -> None:
    tls_dir, target = tmp_path / "data" / "tls", tmp_path / "readable-by-others"
    tls_dir.mkdir(parents=True)
    target.write_bytes(b"")
    (tls_dir / "ca.key").symlink_to(target)
    files = ensure_tls(tmp_path / "data")
    assert target.read_bytes() == b""  # the CA's private key did not go where the link pointed
    assert not (tls_dir / "ca.key").is_symlink() and _mode(tls_dir / "ca.key") == 0o600
    files.key.unlink()
    files.key.symlink_to(target)  # and a link in place of a key in use is refused
    with pytest.raises(kv_secrets.UnsafeSecretPath, match="symbolic link"):
        ensure_tls(tmp_path / "data")


def test_private_file_creates_or_tightens_and_refuses_links(tmp_path: Path) -> None:
    db = tmp_path / "kvgate.db"
    kv_secrets.private_file(db)
    assert _mode(db) == 0o600 and db.read_bytes() == b""
    db.write_bytes(b"rows")
    db.chmod(0o644)
    kv_secrets.private_file(db)
    assert _mode(db) == 0o600 and db.read_bytes() == b"rows"
    link = tmp_path / "link.db"
    link.symlink_to(db)
    with pytest.raises(kv_secrets.UnsafeSecretPath):
        kv_secrets.private_file(link)


_CRASH = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; by default the kernel kills the writer
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
{call}(Path(sys.argv[1]))
"""


def _crash_writing(data_dir: Path, call: str, limit: int) -> None:
    """Run ``call(data_dir)`` in a process the kernel kills once a file it writes reaches ``limit`` bytes."""
    module, name = call.rsplit(".", 1)
    code = f"from {module} import {name}\n" + _CRASH.format(limit=limit, call=name)
    proc = subprocess.run([sys.executable, "-c", code, str(data_dir)], capture_output=True, text=True)
    assert proc.returncode == -25, proc.stderr  # SIGXFSZ: killed mid-write, no clean-up ran


def test_a_crash_mid_write_leaves_no_partial_pepper(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _crash_writing(data_dir, "gateway.secrets.load_or_create_pepper", 16)
    assert not (data_dir / "pepper").exists()
    assert len(load_or_create_pepper(data_dir)) == 32


@pytest.mark.parametrize("limit", [300, 1000])  # within the CA certificate (the keys are whole), the server's
def test_a_crash_mid_write_leaves_no_partial_tls_set(tmp_path: Path, limit: int) -> None:
    """A set made anew (its server key was removed) and cut short: the next start makes a whole one."""
    data_dir = tmp_path / "data"
    ensure_tls(data_dir).key.unlink()
    _crash_writing(data_dir, "gateway.tls.ensure_tls", limit)
    files = ensure_tls(data_dir)
    ssl.create_default_context(cafile=str(files.ca_cert)).load_cert_chain(files.cert, files.key)
    assert _mode(files.key) == _mode(data_dir / "tls" / "ca.key") == 0o600


def test_the_server_process_creates_files_private(tmp_path: Path) -> None:
    """``prepare_data_dir`` (the first step of ``kvgate serve``) sets umask 077 for the process: the SQLite
    database and anything else it creates later are 0600 whatever the umask it was started with."""
    code = ("import os, sqlite3, sys; from pathlib import Path; from gateway.settings import Settings; "
            "from gateway.cli.serve_cmds import prepare_data_dir; os.umask(0o022); "
            "prepare_data_dir(Settings(data_dir=Path(sys.argv[1]))); "
            "sqlite3.connect(Path(sys.argv[1]) / 'kvgate.db').execute('create table t (x)'); "
            "(Path(sys.argv[1]) / 'later').write_bytes(b'x')")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], check=True)
    assert _mode(tmp_path / "d") == 0o700
    assert [_mode(tmp_path / "d" / name) for name in ("kvgate.db", "pepper", "later")] == [0o600] * 3
    assert os.path.getsize(tmp_path / "d" / "kvgate.db") > 0


def test_serve_refuses_a_linked_pepper_with_a_clear_error(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    (data_dir / "pepper").symlink_to(tmp_path / "elsewhere")
    proc = subprocess.run(
        [sys.executable, "-c", "from gateway.cli import app; app()", "serve", "--data-dir", str(data_dir),
         "--port", "0", "--insecure-http"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"kvgate: {data_dir / 'pepper'} is a symbolic link" in proc.stderr
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("command", [["db", "upgrade"], ["admin", "bootstrap"]])
def test_the_first_command_on_a_new_machine_makes_the_data_dir_private(tmp_path: Path, command) -> None:
    """``kvgate db upgrade`` or ``kvgate admin bootstrap`` may run before the first ``serve``: whichever
    creates the data dir and the SQLite database makes them private, under umask 022 too."""
    data_dir = tmp_path / "fresh"
    code = "import os; os.umask(0o022); from gateway.cli import app; app()"
    env = os.environ | {"KVGATE_DATA_DIR": str(data_dir)}
    if command[0] == "admin":
        upgrade = [sys.executable, "-c", code, "db", "upgrade"]
        subprocess.run(upgrade, env=env, check=True, capture_output=True)
        data_dir.chmod(0o755)
        (data_dir / "kvgate.db").chmod(0o644)
    subprocess.run([sys.executable, "-c", code, *command], env=env, check=True, capture_output=True)
    assert _mode(data_dir) == 0o700 and _mode(data_dir / "kvgate.db") == 0o600
    assert not [p for p in data_dir.rglob("*") if p.stat().st_mode & 0o077]
