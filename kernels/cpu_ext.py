"""Build and load the C++ CPU kernels (batch-invariant rows, fused decode) once per machine."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import platform
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

_CSRC = Path(__file__).with_name("csrc")
# No fast-math and no FMA contraction: vectorised and scalar code then round identically, which is what
# makes the kernel's results independent of how the compiler split the loops.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-fopenmp"]
# The fused decode kernel promises no bitwise result, so the compiler may contract and vectorise freely.
_DECODE_CFLAGS = ["-O3", "-march=native", "-fno-fast-math", "-std=c++17", "-fopenmp"]
# torch ships libgomp.so.1 and loads it first, so the extension binds to the same OpenMP runtime and
# honours torch.set_num_threads.
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
# How long a process waits for another one that is building the same kernel (a build takes about a minute).
BUILD_WAIT_S = 600.0


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built (no compiler, no headers)."""


@dataclass(slots=True)
class _Extension:
    prefix: str
    source: Path  # the file that defines the module
    cflags: list[str]
    others: tuple[Path, ...] = ()  # further sources and headers built with it
    module: ModuleType | None = None
    error: KernelBuildError | None = None  # a failed build is not retried in this process

    def sources(self) -> list[Path]:
        return [self.source, *(p for p in self.others if p.suffix == ".cpp")]


_ROWS = _Extension("kvgate_cpu", _CSRC / "paged_attention_rows.cpp", _CFLAGS)
_DECODE = _Extension("kvgate_decode", _CSRC / "fused_decode_layers.cpp", _DECODE_CFLAGS,
                     (_CSRC / "paged_decode_attention.cpp", _CSRC / "q4_linear.cpp", _CSRC / "decode.h"))
_HEAD = _Extension("kvgate_int8", _CSRC / "int8_group_linear.cpp", _DECODE_CFLAGS)


def _cpu_identity() -> str:
    """What -march=native compiles for: the ISA feature list (``flags`` on x86, ``Features`` on ARM).
    Where /proc/cpuinfo says nothing, the host name, so a shared cache never hands one machine's build
    to another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    features = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
    return features or f"host:{platform.node()}"


def _build_tag(ext: _Extension) -> str:
    """Builds use -march=native, so a build is only valid on a CPU with the same instructions. The
    sources' folder and torch's are part of the tag too: ninja rebuilds whenever a source path or an
    include path in its commands changes, so two checkouts (or virtual environments) sharing one cache
    folder would otherwise rebuild each other's kernels on every load, each waiting on the other."""
    paths = (str(ext.source.resolve().parent), str(Path(torch.__file__).resolve().parent))
    material = "|".join((platform.machine(), _cpu_identity(), torch.__version__, *paths, " ".join(ext.cflags),
                         *(p.read_text() for p in (ext.source, *ext.others))))
    return hashlib.sha256(material.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(build_dir: Path, wait_s: float) -> Iterator[None]:
    """Hold an exclusive lock on ``build_dir`` for one build, waiting at most ``wait_s``.

    torch's own build lock is a file that a killed build leaves behind, and torch then waits on it
    forever. The operating system drops a flock when its holder dies, so whoever holds this lock is the
    only builder alive, and a torch lock file found under it is stale and removed.

    Raises:
        KernelBuildError: another live process has held the lock for ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    with open(build_dir / "kvgate.flock", "a") as fd:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelBuildError(f"another process has been building in {build_dir} for "
                                           f"{wait_s:.0f} s; stop it or remove that directory") from None
                time.sleep(0.2)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _load(ext: _Extension, build_root: str | Path) -> ModuleType:
    with _lock:
        if ext.module is not None:
            return ext.module
        if ext.error is not None:
            raise ext.error
        from torch.utils import cpp_extension

        name = f"{ext.prefix}_{_build_tag(ext)}"
        build_dir = Path(build_root) / "kernels" / name
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            with _build_lock(build_dir, BUILD_WAIT_S):
                ext.module = cpp_extension.load(name=name, sources=[str(p) for p in ext.sources()],
                                                build_directory=str(build_dir), extra_cflags=ext.cflags,
                                                extra_ldflags=_LDFLAGS, verbose=False)
        except KernelBuildError as e:
            ext.error = e
            raise
        except (RuntimeError, OSError, ImportError) as e:
            ext.error = KernelBuildError(f"could not build {ext.source.name} in {build_dir}: {e}")
            raise ext.error from e
        return ext.module


def load_cpu_kernels(build_root: str | Path) -> ModuleType:
    """Compile (first time, about a minute) or load the batch-invariant kernels under ``build_root``.

    Raises:
        KernelBuildError: when compilation fails; the message says why.
    """
    return _load(_ROWS, build_root)


def load_int8_kernel(build_root: str | Path) -> ModuleType:
    """Compile (first time, about a minute) or load the grouped int8 linear under ``build_root``.

    Raises:
        KernelBuildError: when compilation fails (also on later calls, without retrying).
    """
    return _load(_HEAD, build_root)


def int8_group_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """``x @ W.T`` for W = q * scale per group of ``group`` inputs (see csrc/int8_group_linear.cpp).

    Args:
        x: [M, K] float32 or bfloat16. q: [N, K] int8. scales: [N, K / group] float32.

    Returns:
        [M, N] float32.

    Raises:
        RuntimeError: the kernel is not loaded, or a shape or dtype is wrong.
    """
    if _HEAD.module is None:
        raise RuntimeError("the int8 kernel is not loaded: call load_int8_kernel first")
    return _HEAD.module.int8_group_linear(x, q, scales, group)


def load_decode_kernel(build_root: str | Path) -> ModuleType:
    """Compile (first time, about a minute) or load the fused decode-attention kernel under ``build_root``.

    Raises:
        KernelBuildError: when compilation fails (also on later calls, without retrying).
    """
    return _load(_DECODE, build_root)


def decode_kernel_loaded() -> bool:
    """Whether ``paged_decode_attention`` is ready in this process."""
    return _DECODE.module is not None


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
    if _ROWS.module is None:
        raise RuntimeError("the C++ CPU kernels are not loaded: call load_cpu_kernels first")
    return _ROWS.module.paged_attention_rows(query, k_cache, v_cache, block_tables, row_seq, row_ctx, scale)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One decode token per row over its paged context, fused (see csrc/paged_decode_attention.cpp).

    Args:
        query: [B, num_heads, head_dim] float32 or bfloat16.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16.
        block_tables: [B, max_blocks] int64; entries past a row's context are never read.
        context_lens: [B] int64, keys each row attends to (at least 1).
        scale: softmax scale.

    Returns:
        [B, num_heads, head_dim] in the query's dtype (float32 accumulation).

    Raises:
        RuntimeError: the kernel is not loaded, or a shape, dtype, length or block id is out of range.
    """
    if _DECODE.module is None:
        raise RuntimeError("the fused decode kernel is not loaded: call load_decode_kernel first")
    return _DECODE.module.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)


@dataclass(slots=True)
class DecodeLayerWeights:
    """What ``fused_decode_layers`` reads of every layer, in layer order: the two RMSNorm weights
    (bfloat16 [hidden]) and the 4-bit weights (``q4_linear``'s nibbles, scales, mins) of qkv, o, gate_up
    and down."""

    norms: list[torch.Tensor]  # 2 per layer
    nibbles: list[torch.Tensor]  # 4 per layer
    scales: list[torch.Tensor]
    mins: list[torch.Tensor]


def fused_decode_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: DecodeLayerWeights,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
                        decode_rows: tuple[torch.Tensor, torch.Tensor], heads: tuple[int, int, int],
                        eps: float, scale: float) -> torch.Tensor:
    """Every decoder layer of a decode-only step of a few rows, in one call (csrc/fused_decode_layers.cpp).

    Args:
        x: [rows, hidden] bfloat16 embeddings. cos, sin: [rows, head_dim] bfloat16 at each row's position.
        weights: every layer's norms and 4-bit weights (no biases).
        kv_caches: each layer's (K, V) [num_blocks, block_size, num_kv_heads, head_dim], float32 or
            bfloat16; each row's new K/V is written at its ``slot_mapping`` slot.
        decode_rows: each row's block table [rows, max_blocks] and context length [rows] (including
            the new token).
        heads: (num_heads, num_kv_heads, head_dim).

    Returns:
        [rows, hidden] bfloat16: the last layer's output (before the final norm).

    Raises:
        RuntimeError: the kernel is not loaded, or a shape, dtype, slot or block id is out of range.
    """
    return _fused_call("fused_decode_layers", x, cos, sin, (weights.norms, weights.nibbles, weights.scales,
                       weights.mins), kv_caches, slot_mapping, decode_rows, heads, eps, scale)


def fused_dense_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: list[torch.Tensor],
                       weights: list[torch.Tensor], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       slot_mapping: torch.Tensor, decode_rows: tuple[torch.Tensor, torch.Tensor],
                       heads: tuple[int, int, int], eps: float, scale: float) -> torch.Tensor:
    """Every decoder layer of a decode-only step on the dense bfloat16 weights, in one call: what
    ``fused_decode_layers`` does, with ATen's bfloat16 linear for the matmuls (for steps of any size).

    Args:
        norms: the two RMSNorm weights of every layer (bfloat16 [hidden]), in layer order.
        weights: qkv, o, gate_up and down of every layer (bfloat16 [out, in], no biases), in layer order.
        The other arguments are ``fused_decode_layers``'s.

    Returns:
        [rows, hidden] bfloat16: the last layer's output (before the final norm).

    Raises:
        RuntimeError: the kernel is not loaded, or a shape, dtype, slot or block id is out of range.
    """
    return _fused_call("fused_dense_layers", x, cos, sin, (norms, weights), kv_caches, slot_mapping,
                       decode_rows, heads, eps, scale)


def _fused_call(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: tuple,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
                decode_rows: tuple[torch.Tensor, torch.Tensor], heads: tuple[int, int, int], eps: float,
                scale: float) -> torch.Tensor:
    if _DECODE.module is None:
        raise RuntimeError("the fused decode kernel is not loaded: call load_decode_kernel first")
    tables, lens = decode_rows
    return getattr(_DECODE.module, name)(x, cos, sin, *weights, [k for k, _ in kv_caches],
                                         [v for _, v in kv_caches], slot_mapping, tables, lens, *heads, eps,
                                         scale)


def q4_linear(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a 4-bit W (w = q * scale + min per group of 32 inputs), x quantized to int8 per
    group of 32 (see csrc/q4_linear.cpp).

    Args:
        x: [M <= 16, K] float32 or bfloat16. nibbles: [N, K / 2] uint8. scales, mins: [N, K / 32] float16.

    Returns:
        [M, N] in x's dtype.

    Raises:
        RuntimeError: the kernel is not loaded, or a shape or dtype is wrong.
    """
    if _DECODE.module is None:
        raise RuntimeError("the fused decode kernel is not loaded: call load_decode_kernel first")
    return _DECODE.module.q4_linear(x, nibbles, scales, mins)
