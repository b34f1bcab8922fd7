"""The engine process hands its heap's free pages back to the system
(``engine.runner.allocator.HeapTrimmer``): glibc keeps what a step frees inside a fragmented heap
resident, and the engine child's RSS grew under sustained mixed traffic until it trimmed when idle and
every few seconds while it works."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine import EngineConfig, SamplingParams
from engine.front.process import ProcessLLMEngine
from engine.runner.allocator import HeapTrimmer
from tests.engine import malloc_probe

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator"),
              pytest.mark.timeout(120)]

MIB = 1 << 20
_MIN_RELEASED_MIB = malloc_probe.FRAGMENT_MIB * 3 // 4  # most of it: the engine may reuse some

_PROBE = """
import psutil
from tests.engine.malloc_probe import fragment_heap
from engine.runner.allocator import HeapTrimmer
rss = lambda: psutil.Process().memory_info().rss >> 20
before = rss(); fragment_heap(); fragmented = rss()
HeapTrimmer(0).trim(); off = rss()
trimmer = HeapTrimmer(5.0); trimmer.on_idle(); idle = rss()
trimmer.trim(); print(before, fragmented, off, idle, rss())
"""


def test_a_fragmented_heap_stays_resident_until_trimmed() -> None:
    """In a fresh process: RSS (MiB) before and after fragmenting the heap, after a trimmer that is off
    trims, after an idle one that ran no step since it started, and after one that trims."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=root, check=True, capture_output=True,
                         text=True).stdout
    before, fragmented, off, idle, trimmed = map(int, out.split())
    assert fragmented - before >= malloc_probe.FRAGMENT_MIB  # glibc keeps the freed pages: the growth
    assert off == pytest.approx(fragmented, abs=16)
    assert idle == pytest.approx(fragmented, abs=16)  # an idle engine that did nothing does not trim
    assert fragmented - trimmed >= _MIN_RELEASED_MIB


def test_it_trims_once_idle_after_work_and_every_interval_while_busy() -> None:
    now = [0.0]
    trimmer = HeapTrimmer(5.0, clock=lambda: now[0])
    trimmer.on_idle()
    assert trimmer.num_trims == 0  # nothing ran since the start
    for t in (1.0, 3.0, 4.9):
        now[0] = t
        trimmer.after_step()
    assert trimmer.num_trims == 0
    now[0] = 5.0
    trimmer.after_step()
    assert trimmer.num_trims == 1
    trimmer.on_idle()
    assert trimmer.num_trims == 1  # trimmed at 5 s, no step since
    now[0] = 6.0
    trimmer.after_step()
    trimmer.on_idle()
    trimmer.on_idle()
    assert trimmer.num_trims == 2 and trimmer.trim_s > 0
    now[0] = 10.9
    trimmer.after_step()
    assert trimmer.num_trims == 2
    now[0] = 11.0
    trimmer.after_step()  # five seconds after the idle trim
    assert trimmer.num_trims == 3


def _child_rss_mib(engine: ProcessLLMEngine) -> int:
    return psutil.Process(engine._child.proc.pid).memory_info().rss // MIB


async def _serve_one_then_rss(engine: ProcessLLMEngine, target_mib: int, wait_s: float) -> int:
    """Serve a request, then the child's lowest RSS (MiB) while idle: as soon as it is at or below
    ``target_mib``, else after ``wait_s`` seconds."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async for _ in engine.generate([5] * 16, params):
        pass
    lowest, deadline = _child_rss_mib(engine), time.monotonic() + wait_s
    while lowest > target_mib and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        lowest = min(lowest, _child_rss_mib(engine))
    return lowest


async def test_the_engine_process_trims_its_heap_once_idle_by_default(tiny_llama_dir: Path) -> None:
    # With heap_trim_interval_s=0 (glibc's behaviour before the trimmer) the child kept all of it.
    # Only a fast request: without batch_invariant the child skips its start-up check of row-invariant
    # matmuls (over a second on two cores; test_determinism covers it).
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=32,
                          determinism_modes=("fast", "fixed"))
    # The heap is fragmented in the child before the engine loads (the initializer runs first).
    engine = ProcessLLMEngine(config, initializer=malloc_probe.fragment_heap)
    engine.start()
    try:
        loaded = _child_rss_mib(engine)
        idle = await _serve_one_then_rss(engine, loaded - _MIN_RELEASED_MIB, wait_s=2.0)
    finally:
        engine.shutdown()
    assert loaded - idle >= _MIN_RELEASED_MIB


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="heap_trim_interval_s"):
        EngineConfig(heap_trim_interval_s=-1.0)
