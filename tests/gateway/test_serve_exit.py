"""``kvgate serve`` stopped by SIGTERM exits 0 at once after its shutdown, its engine child too: neither
runs the interpreter's finalization (a collection of the whole heap, seconds of every stop); a SIGTERM
that reaches the engine child too stops it once, and an idle client does not hold the exit up."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
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


def test_sigterm_to_serve_and_its_engine_stops_the_engine_once_and_exits_at_once(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """As a service manager stops a unit (systemd signals every process in it) while a client keeps an
    idle TLS connection open: the engine child serves the drain and is stopped once, no new one is
    started, nothing logs a traceback, and the exit does not wait for the idle client (uvicorn waited
    out its 5 s graceful timeout for it)."""
    args = ("--num-kv-blocks", "64", "--determinism-modes", "fast")
    with serve(tmp_path, tiny_model_dir, *args) as server, \
            httpx.Client(base_url=server.base, verify=str(server.ca), timeout=30) as idle:
        assert idle.get("/healthz").status_code == 200  # the connection stays in the client's pool
        engine = psutil.Process(server.engine_pid())
        started = time.monotonic()
        for process in (server.proc, engine):
            process.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()
        exit_s = time.monotonic() - started
        engine.wait(30)
    time.sleep(2)  # what a child still loading would print when it found its parent gone
    log = server.log()
    assert "shutdown.drained" in log
    assert "engine process lost" not in log and "restarted" not in log and log.count("KV cache:") == 1, log
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log
    assert exit_s < 20, (exit_s, log)  # generous: it takes well under a second
