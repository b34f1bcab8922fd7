"""The engine child's exit: prompt (no interpreter finalization, whose collection of the whole heap the
gateway's shutdown waited for), clean (exit code 0) and with its last log lines written."""

from __future__ import annotations

import atexit
import logging
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.front.process import ProcessLLMEngine
from engine.front.process_child import EngineChild

pytestmark = pytest.mark.timeout(600)  # an engine start takes minutes on loaded cores


def _watch_exit(marker: str, log_path: str) -> None:
    """In the child: ``marker`` is written if the interpreter finalizes (atexit handlers run then), and
    the engine's logs go to ``log_path`` through a buffer that only a flush writes out."""
    atexit.register(Path(marker).write_text, "finalized")
    handler = logging.StreamHandler(open(log_path, "w", buffering=1 << 20))  # noqa: SIM115
    logging.getLogger("kvgate.engine").addHandler(handler)
    logging.getLogger("kvgate.engine").setLevel(logging.INFO)


@pytest.fixture
def config(tiny_llama_dir):
    # Without batch_invariant the child skips its start-up check of row-invariant matmuls (over a second
    # on two cores, and nothing to do with how it exits; test_determinism covers it).
    return EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256,
                        determinism_modes=("fast", "fixed"))


def test_a_stopped_child_exits_by_itself_without_finalizing(config, tmp_path):
    marker, log = tmp_path / "finalized", tmp_path / "child.log"
    engine = ProcessLLMEngine(config, initializer=_watch_exit, initargs=(str(marker), str(log)))
    engine.start()
    child = engine._child
    engine.shutdown()
    assert child.proc.exitcode == 0  # it ended itself: a kill after the timeout reads -9
    assert not marker.exists()


def test_a_child_whose_parent_went_away_logs_it_and_exits_without_finalizing(config, tmp_path):
    marker, log = tmp_path / "finalized", tmp_path / "child.log"
    child = EngineChild(config, _watch_exit, (str(marker), str(log)))
    child.wait_ready(500)
    child.close()  # the parent's ends of both pipes, as when the gateway dies
    child.proc.join(120)
    assert child.proc.exitcode == 0
    assert "the gateway closed its pipe; exiting" in log.read_text()  # flushed before the exit
    assert not marker.exists()
