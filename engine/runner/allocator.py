"""The engine process's C allocator: what a step frees goes back to the system.

glibc serves a request above its mmap threshold (128 KiB at start) with a mapping of its own, unmapped on
free, but raises the threshold to the size of each such block freed (up to 32 MiB). After the first large
step, the model's activations and logits and oneDNN's per-shape primitives and scratch buffers (bfloat16
matmuls on the CPU; a step's token count changes all the time, and each new count is a new shape, its
primitive made anew once the library's LRU caches are full) all come from the heap, which fragments: its
free chunks lie between live ones, so it never shrinks from the top, and under sustained mixed traffic the
engine process's RSS kept growing (``kvgate bench soak``, docs/operations.md).

Two remedies. ``HeapTrimmer`` (the default) calls ``malloc_trim(0)`` when the engine goes idle and every
few seconds while it works: glibc then hands the whole free pages inside the heap back to the system
(``madvise``), so RSS comes back to what is live, and the steps in between reuse the heap's warm pages at
full speed. ``fix_mmap_threshold`` (opt-in) keeps every large block in a mapping of its own, so nothing
large is ever kept, but every step maps and faults its large buffers in anew, which costs about a fifth
of the throughput.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

logger = logging.getLogger("kvgate.engine")

MMAP_THRESHOLD = 128 << 10  # glibc's own starting value, now fixed
_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    is_glibc = all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "gnu_get_libc_version"))
    return libc if is_glibc else None


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (setting it turns the dynamic raise off) and its
    trim threshold at twice that (the heap's free top beyond it is returned). Call it first thing in the
    process, before the big allocations. Returns False, changing nothing, where the C library is not glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    is_set = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
    if not is_set:
        logger.warning("engine process: glibc refused the mmap threshold %d; its RSS may grow", threshold)
    return is_set


class HeapTrimmer:
    """Returns the heap's free pages to the system (``malloc_trim(0)``) once the engine goes idle after
    work, and every ``interval_s`` seconds while it works; off where ``interval_s`` is 0 or the C library
    is not glibc. ``num_trims`` and ``trim_s`` (seconds spent in ``malloc_trim``) say what it cost."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        libc = _libc() if interval_s > 0 else None
        self._malloc_trim = libc.malloc_trim if libc is not None else None
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self._has_worked = False  # steps ran since the last trim
        self.num_trims = 0
        self.trim_s = 0.0

    @property
    def is_on(self) -> bool:
        return self._malloc_trim is not None

    def after_step(self) -> None:
        """A step ran: trim if ``interval_s`` has passed since the last trim."""
        self._has_worked = True
        if self._clock() - self._last >= self.interval_s:
            self.trim()

    def on_idle(self) -> None:
        """Nothing to run: trim once if steps ran since the last trim (an idle engine costs nothing)."""
        if self._has_worked:
            self.trim()

    def trim(self) -> None:
        if self._malloc_trim is None:
            return
        t0 = time.perf_counter()
        self._malloc_trim(0)
        self.trim_s += time.perf_counter() - t0
        self.num_trims += 1
        self._has_worked = False
        self._last = self._clock()
