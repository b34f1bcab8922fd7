"""Kernel builds survive a build killed half-way (torch's lock file left behind) and never wait forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.runner.setup import default_cache_dir
from kernels import KernelBuildError
from kernels.cpu_ext import _DECODE, _build_lock, _build_tag, _Extension

ROOT = Path(__file__).resolve().parents[2]


def test_stale_torch_lock_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    build_dir = default_cache_dir() / "kernels" / f"{_DECODE.prefix}_{_build_tag(_DECODE)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    stale = build_dir / "lock"
    stale.touch()  # what a build killed by a timeout or SIGKILL leaves behind
    code = f"from kernels import load_decode_kernel; load_decode_kernel({str(default_cache_dir())!r})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the kernel waited on a stale lock file")
    finally:
        stale.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_live_builder_is_waited_for_only_until_the_deadline(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(tmp_path / "kvgate.flock")!r}, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(KernelBuildError, match="another process"), _build_lock(tmp_path, wait_s=0.5):
            pass
        assert time.monotonic() - t0 < 10
    finally:
        holder.kill()
        holder.wait()
    with _build_lock(tmp_path, wait_s=5):  # the holder died: the OS released its lock
        assert not (tmp_path / "lock").exists()


def test_another_checkout_of_the_same_sources_builds_in_its_own_folder(tmp_path: Path) -> None:
    """ninja rebuilds when a source path changes: two checkouts sharing one cache must not share a build
    folder, or each load rebuilds what the other built."""
    copies = [tmp_path / "a", tmp_path / "b"]
    tags = []
    for folder in copies:
        folder.mkdir()
        for p in (_DECODE.source, *_DECODE.others):
            (folder / p.name).write_text(p.read_text())
        ext = _Extension(_DECODE.prefix, folder / _DECODE.source.name, _DECODE.cflags,
                         tuple(folder / p.name for p in _DECODE.others))
        tags.append(_build_tag(ext))
    assert tags[0] != tags[1] != _build_tag(_DECODE)
    (copies[0] / _DECODE.source.name).write_text("// changed\n")  # and the contents still count
    assert _build_tag(_Extension(_DECODE.prefix, copies[0] / _DECODE.source.name, _DECODE.cflags,
                                 tuple(copies[0] / p.name for p in _DECODE.others))) != tags[0]
