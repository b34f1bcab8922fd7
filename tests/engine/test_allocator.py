"""The engine process fixes glibc's mmap threshold (``engine.runner.allocator``): what a step frees in large
blocks goes back to the system instead of fragmenting a heap that never shrinks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine import malloc_probe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")

_PROBE = "from tests.engine.malloc_probe import is_medium_block_mapped as m; {setup}; print(m())"


def _probe(setup: str) -> bool:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _PROBE.format(setup=setup)], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return out.strip() == "True"


def test_without_the_fix_a_freed_large_block_sends_later_blocks_to_the_heap() -> None:
    assert _probe("pass") is False  # glibc's dynamic threshold: what the fix is for


def test_the_fixed_threshold_keeps_large_blocks_in_mappings_of_their_own() -> None:
    assert _probe("from engine.runner.allocator import fix_mmap_threshold as f; assert f()") is True


def test_the_engine_process_starts_with_the_threshold_fixed_when_asked(tiny_llama_dir: Path) -> None:
    from engine import EngineConfig
    from engine.front.process import ProcessLLMEngine

    # The probe runs in the child before the engine loads; raising there, it fails the child's start.
    engine = ProcessLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=32,
                                           fixed_mmap_threshold=True), initializer=malloc_probe.check_fixed)
    engine.shutdown()
