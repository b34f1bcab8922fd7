"""Build and load the C++ CPU kernels (batch-invariant paged attention) once per machine."""

from __future__ import annotations

import hashlib
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_rows.cpp"
# No fast-math and no FMA contraction: vectorised and scalar code then round identically, which is what
# makes the kernel's results independent of how the compiler split the loops.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-fopenmp"]
# torch ships libgomp.so.1 and loads it first, so the extension binds to the same OpenMP runtime and
# honours torch.set_num_threads.
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_module: ModuleType | None = None


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built (no compiler, no headers)."""


def _cpu_tag() -> str:
    """Builds use -march=native, so a build is only valid on the CPU it was made for."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    material = "|".join((platform.machine(), flags, torch.__version__, " ".join(_CFLAGS),
                         _SOURCE.read_text()))
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def load_cpu_kernels(build_root: str | Path) -> ModuleType:
    """Compile (first time, about a minute) or load the extension under ``build_root``.

    Raises:
        KernelBuildError: when compilation fails; the message says why.
    """
    global _module
    with _lock:
        if _module is not None:
            return _module
        from torch.utils import cpp_extension

        name = f"kvgate_cpu_{_cpu_tag()}"
        build_dir = Path(build_root) / "kernels" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            _module = cpp_extension.load(name=name, sources=[str(_SOURCE)], build_directory=str(build_dir),
                                         extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                                         verbose=False)
        except (RuntimeError, OSError, ImportError) as e:
            raise KernelBuildError(f"could not build the C++ CPU kernels in {build_dir}: {e}") from e
        return _module


def paged_attention_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, row_seq: torch.Tensor, row_ctx: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Batch-invariant attention, one query row at a time (see csrc/paged_attention_rows.cpp).

    Args:
        query: [R, num_heads, head_dim] float32.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] float32.
        block_tables: [S, max_blocks] int64; row_seq: [R] int64; row_ctx: [R] int64 keys per row.

    Returns:
        [R, num_heads, head_dim].
    """
    if _module is None:
        raise RuntimeError("the C++ CPU kernels are not loaded: call load_cpu_kernels first")
    return _module.paged_attention_rows(query, k_cache, v_cache, block_tables, row_seq, row_ctx, scale)
