"""``kvgate serve`` stopped by SIGTERM exits 0 at once after its shutdown, its engine child too: neither
runs the interpreter's finalization (a collection of the whole heap, seconds of every stop)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from .served import serve

pytestmark = pytest.mark.timeout(600)  # a server's start takes minutes on loaded cores
SITECUSTOMIZE = """import atexit, os, pathlib
atexit.register(lambda: (pathlib.Path({dir!r}) / f"finalized-{{os.getpid()}}").write_text("yes"))
"""


def test_sigterm_ends_serve_and_its_engine_child_without_finalizing(tmp_path: Path,
                                                                    tiny_model_dir: Path) -> None:
    site, markers, data = tmp_path / "site", tmp_path / "markers", tmp_path / "data"
    for d in (site, markers, data):
        d.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(dir=str(markers)))
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    # no determinism mode whose kernels take seconds to prove at start-up: the exit is what is tested
    args = ("--num-kv-blocks", "64", "--determinism-modes", "fast")
    with serve(data, tiny_model_dir, *args, env=env) as server:
        child = psutil.Process(server.engine_pid())
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(120) == 0
        child.wait(60)
        assert "shutdown.drained" in server.log()  # logged, and written out before the exit
        pids = {server.proc.pid, child.pid}
    # neither process finalized (multiprocessing's resource tracker does, as usual)
    assert not [m.name for m in markers.iterdir() if int(m.name.rsplit("-", 1)[1]) in pids]
