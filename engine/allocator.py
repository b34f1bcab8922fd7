"""The engine process's C allocator: large buffers go back to the system when freed.

glibc serves a request above its mmap threshold (128 KiB at start) with a mapping of its own, unmapped on
free, but raises the threshold to the size of each such block freed (up to 32 MiB). After the first large
step, the model's activations and logits and oneDNN's per-shape primitives and scratch buffers (bfloat16
matmuls on the CPU; a step's token count changes all the time, and each new count is a new shape, its
primitive made anew once the library's LRU caches are full) all come from the heap, which fragments and
does not shrink: under sustained mixed traffic the engine process's RSS kept growing (``kvgate bench
soak``, docs/operations.md). With the threshold fixed, large blocks keep mappings of their own, what a
step frees goes back to the system, and RSS stays at what is live: weights, KV pool, bounded caches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

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
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


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
