"""Whether glibc's mmap threshold stays fixed in this process: after a large block is freed (which raises
a dynamic threshold to its size), a 1 MiB block still gets a mapping of its own.

``check_fixed`` is module-level: ``ProcessLLMEngine(initializer=check_fixed)`` runs it in the engine's child
process, where it raises (so the child fails to start) if the threshold is not fixed.
"""

from __future__ import annotations

import ctypes

LARGE, MEDIUM = 16 << 20, 1 << 20


_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
           "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def is_medium_block_mapped() -> bool:
    """Free a 16 MiB block, then take 1 MiB: whether that block is a mapping of its own (else the heap's)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    libc.free(libc.malloc(LARGE))
    before = libc.mallinfo2().hblks
    block = libc.malloc(MEDIUM)
    try:
        return libc.mallinfo2().hblks == before + 1
    finally:
        libc.free(block)


def check_fixed() -> None:
    if not is_medium_block_mapped():
        raise RuntimeError("glibc's mmap threshold is not fixed in the engine process")


FRAGMENT_MIB = 256  # freed, resident MiB that ``fragment_heap`` leaves inside the heap
_pinned: list[int] = []  # the live blocks between them (kept for the process's life)


def fragment_heap() -> None:
    """Leave ``FRAGMENT_MIB`` MiB of freed but resident pages inside the heap, each MiB between two live
    blocks so that the heap cannot shrink from its top: what the engine's per-shape buffers did.

    Module-level: ``ProcessLLMEngine(initializer=fragment_heap)`` runs it in the engine's child process.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(LARGE))  # glibc's dynamic mmap threshold rises: 1 MiB blocks come from the heap
    blocks = []
    for _ in range(FRAGMENT_MIB):
        block = libc.malloc(MEDIUM)
        ctypes.memset(block, 1, MEDIUM)  # resident, as a step's buffers are
        blocks.append(block)
        # A pin of the same size comes from the heap's top, right after (a small one would fill a hole).
        _pinned.append(libc.malloc(MEDIUM))
    for block in blocks:
        libc.free(block)
