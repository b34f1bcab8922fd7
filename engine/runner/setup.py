"""Build everything the engine runs on: model weights, tokenizer, thread pinning and the KV pool."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from engine.config import EngineConfig
from engine.determinism import (
    BATCH_INVARIANT,
    FIXED,
    INVARIANT_TILE_ROWS,
    Determinism,
    TilePlan,
    TritonPlan,
    tokenizer_digest,
    verify_row_invariance,
    weights_digest,
)
from engine.errors import ModelLoadError
from engine.models import LlamaForCausalLM
from engine.runner.kv_alloc import (
    DTYPES,
    allocate_kv_caches,
    bytes_per_block,
    check_kv_dtype,
    kv_dtype,
    pool_nbytes,
)
from engine.runner.loader import (
    DEFAULT_MODEL_NAME,
    ModelConfig,
    default_cache_dir,
    load_model_config,
    load_state_dict,
    load_tokenizer,
    resolve_model_dir,
)
from kernels import KernelBuildError, load_cpu_kernels, load_decode_kernel
from kernels.cpu_ext import load_int8_kernel
from kernels.int4 import int4_available

logger = logging.getLogger("kvgate.engine")

_decode_warned = False


@dataclass(slots=True)
class LoadedModel:
    name: str
    model_dir: Path
    model: LlamaForCausalLM
    model_config: ModelConfig
    tokenizer: object
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # num_blocks + 1 blocks: the last is the null block
    num_blocks: int  # blocks the pool allocates
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]


def physical_cores() -> int:
    """This machine's physical cores (its logical ones where the OS does not tell)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def pin_threads(num_threads: int | None) -> int:
    """Pin torch's intra-op threads (small-M matmuls are erratic when threads are oversubscribed)."""
    n = num_threads or physical_cores()
    torch.set_num_threads(n)
    return n


def _model_name(model: str | None) -> str:
    if model in (None, "default", DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME
    return Path(model).stem if model.endswith(".gguf") else Path(model).name


def _num_blocks(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(config, mc, dtype)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * config.kv_cache_fraction)
    else:
        budget = int(psutil.virtual_memory().available * config.kv_cache_fraction)
    n = budget // per_block - 1  # the budget holds the null block too (see ``load_model``)
    if n < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block ({per_block} bytes each, "
                         f"and one more that is never allocated)")
    return n


def has_fast_bf16_matmul() -> bool:
    """This CPU has bfloat16 matrix instructions (AVX512_BF16 or AMX), so bfloat16 GEMMs beat float32's."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
                     "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype ``auto`` stands for on this device, or the one named."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" or has_fast_bf16_matmul() else torch.float32


def _maybe_pack_int4(config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype,
                     device: torch.device) -> None:
    """Give the layers 4-bit copies for few-row steps where ``int4_decode`` asks for them and they run."""
    max_rows = config.int4_max_rows if config.int4_max_rows is not None else (
        16 if dtype == torch.float32 else 8)
    if config.int4_decode == "off" or max_rows == 0:
        return
    # bfloat16 rows go through torch's int4 matmul, float32 rows through q4_linear (the decode kernel's);
    # under ``auto``, a float32 model uses them only where ``dtype="auto"`` chose float32 (a CPU without
    # bfloat16 matrix instructions): an explicit float32 asks for transformers' exact arithmetic
    wanted_f32 = config.dtype == "auto" or config.int4_decode == "on"
    on_cpu = device.type == "cpu"
    runs = (dtype == torch.bfloat16 and int4_available(device)) or (
        dtype == torch.float32 and on_cpu and wanted_f32 and prepare_decode_kernel(config.cache_dir))
    if not runs:
        if config.int4_decode == "on":
            raise ValueError("int4_decode='on' needs a bfloat16 or float32 model on the CPU (and, in "
                             "float32, the C++ decode kernel)")
        return
    exact_only = config.int4_decode == "auto"
    with torch.inference_mode():
        used = model.pack_int4(max_rows, exact_only)
        head = used and prepare_int8_kernel(config.cache_dir) and model.pack_int8_head(exact_only)
    model.fused_decode = model.fused_decode and config.fused_decode
    logger.info("4-bit layer weights for steps of <= %d tokens: %s; 8-bit LM head: %s", max_rows,
                "on" if used else "off (the checkpoint's weights are not 4-bit)", "on" if head else "off")


def build_model(config: EngineConfig, mc: ModelConfig, state: dict, max_model_len: int, dtype: torch.dtype,
                device: torch.device) -> LlamaForCausalLM:
    """Construct on the meta device (no wasted random init), then materialize and copy the weights (and
    pack their 4-bit copies from the checkpoint's own values, before a cast rounds them)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(mc, max_model_len)
    model = model.to_empty(device="cpu")
    model.init_rope(max_model_len)
    model.load_hf_state_dict(state)
    _maybe_pack_int4(config, model, dtype, device)
    model = model.to(device=device, dtype=dtype).eval()
    model.place_head()
    # the fused step has no bias terms: models with any (Qwen2's qkv) decode layer by layer
    model.fused_dense = (config.fused_decode and device.type == "cpu"
                         and dtype in (torch.bfloat16, torch.float32) and not (mc.qkv_bias or mc.o_bias))
    return model


def load_model(config: EngineConfig) -> LoadedModel:
    """Resolve, load and place the model; allocate the KV pool. Logs "N blocks = M tokens"."""
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA device is available")
    if device.type == "cpu":
        pin_threads(config.num_threads)
        prepare_decode_kernel(config.cache_dir)
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    mc = load_model_config(model_dir)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    model = build_model(config, mc, load_state_dict(model_dir), max_model_len, dtype, device)
    tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else model_dir)
    check_kv_dtype(config, device)
    cache_dtype = kv_dtype(config, dtype, device)
    num_blocks = _num_blocks(config, mc, cache_dtype, device)
    # One block more than the pool hands out: the last one, the null block (id ``num_blocks``), is never
    # allocated, so nothing writes it and it stays zero. Block tables are padded with it, so a kernel
    # that reads padding reads zeros, never another sequence's (possibly non-finite) K/V.
    shape = (num_blocks + 1, config.block_size, mc.num_kv_heads, mc.head_dim)
    kv_caches = allocate_kv_caches(config, shape, mc.num_layers, cache_dtype, dtype, device)
    logger.info("KV cache: %d blocks = %d tokens (%.0f MiB, %s%s)", num_blocks,
                num_blocks * config.block_size, pool_nbytes(kv_caches) / 2**20, cache_dtype,
                " with a float32 scale per token and head" if cache_dtype.itemsize == 1 else "")
    eos = set(mc.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return LoadedModel(_model_name(config.model), model_dir, model, mc, tokenizer, kv_caches, num_blocks,
                       max_model_len, device, dtype, tuple(sorted(eos)))


def setup_determinism(config: EngineConfig, loaded: LoadedModel) -> Determinism:
    """Turn on what the served modes need and compute the per-mode system fingerprints."""
    if FIXED in config.determinism_modes and loaded.device.type == "cuda":
        # cuBLAS needs a fixed workspace for deterministic results (read when its handle is created, so
        # it is set for the process; it sizes a workspace and slows nothing). The deterministic-algorithm
        # switches themselves are on only during steps that hold ``fixed`` sequences
        # (``engine.determinism.deterministic_algorithms``).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    bi_error, plan = None, None
    if BATCH_INVARIANT in config.determinism_modes:
        bi_error, plan = _enable_batch_invariance(config, loaded)
        if bi_error:
            logger.warning("batch_invariant mode disabled: %s", bi_error)
    kernel_config = {"dtype": str(loaded.dtype), "kv_dtype": str(loaded.kv_caches[0][0].dtype),
                     "threads": torch.get_num_threads(), "device": loaded.device.type,
                     "int4_max_rows": loaded.model.int4_max_rows,
                     "int8_head": loaded.model.head_int8 is not None,
                     "block_size": config.block_size, "linear_tile_rows": INVARIANT_TILE_ROWS,
                     "invariant_kernels": (getattr(plan, "config", None)
                                           or getattr(plan, "attention_backend", None))}
    parts = (weights_digest(loaded.model), tokenizer_digest(loaded.tokenizer))
    schedule = {"max_num_batched_tokens": config.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
                "enable_prefix_caching": config.enable_prefix_caching}
    return Determinism(config.determinism_modes, parts, kernel_config, bi_error, schedule, plan)


def _enable_batch_invariance(config: EngineConfig, loaded: LoadedModel
                             ) -> tuple[str | None, TilePlan | TritonPlan | None]:
    """Load the batch-invariant kernels for this device, plan the matmuls and prove row invariance here;
    return (why not, None) or (None, the plan). batch_invariant is one optional mode, so any failure here
    (a Triton compile or launch error on an untried GPU, a kernel's RuntimeError) turns it off rather
    than stopping the engine; interrupts and exits still propagate."""
    try:
        return _build_invariant_plan(config, loaded)
    except Exception as e:
        logger.debug("batch_invariant start-up failed", exc_info=True)
        return f"enabling it failed with {type(e).__name__}: {e}", None


def _build_invariant_plan(config: EngineConfig, loaded: LoadedModel
                          ) -> tuple[str | None, TilePlan | TritonPlan | None]:
    """The work of ``_enable_batch_invariance``; raises whatever the kernels, plan or check raise."""
    backend = config.invariant_backend
    if backend == "auto":
        backend = "triton" if loaded.device.type == "cuda" else "cpp"
    plan: TilePlan | TritonPlan
    if backend == "triton":
        if loaded.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "the Triton batch-invariant kernels run on a CPU only under TRITON_INTERPRET=1", None
        try:
            plan = TritonPlan()
        except ImportError as e:
            return f"the Triton batch-invariant kernels need triton: {e}", None
    else:
        if loaded.device.type != "cpu":
            return ("the C++ batch-invariant kernels run on the CPU only "
                    "(use invariant_backend='triton')"), None
        if loaded.kv_caches[0][0].dtype not in (torch.float32, torch.bfloat16):
            return "batch_invariant on the CPU needs a float32 or bfloat16 KV cache", None
        if error := prepare_cpu_kernels(config.cache_dir):
            return error, None
    with torch.inference_mode():
        per_token, head = loaded.model.linears()
        groups = [(per_token, config.max_num_batched_tokens), (head, config.max_num_seqs)]
        if backend == "cpp":
            plan = TilePlan.build(groups)
        for linears, rows in groups:
            if error := verify_row_invariance(linears, rows, plan):
                return error, None
    return None, plan


def prepare_cpu_kernels(cache_dir: str | None = None) -> str | None:
    """Build (once) the C++ CPU kernels: the fused decode kernel and the one batch_invariant mode needs;
    return why the latter is unavailable, or None."""
    prepare_decode_kernel(cache_dir)
    prepare_int8_kernel(cache_dir)
    try:
        load_cpu_kernels(_kernel_root(cache_dir))
    except KernelBuildError as e:
        return str(e)
    return None


def _kernel_root(cache_dir: str | None) -> Path:
    return Path(cache_dir) if cache_dir else default_cache_dir()


def prepare_int8_kernel(cache_dir: str | None = None) -> bool:
    """Build (once per machine) or load the grouped int8 kernel of the LM head's 8-bit copy; without it
    the head stays bfloat16 (logged)."""
    try:
        load_int8_kernel(_kernel_root(cache_dir))
    except KernelBuildError as e:
        logger.warning("8-bit LM head unavailable: %s", e)
        return False
    return True


def prepare_decode_kernel(cache_dir: str | None = None) -> bool:
    """Build (once per machine) or load the fused CPU decode-attention kernel. Without it the CPU decodes
    on the torch path, which is logged once per process."""
    global _decode_warned
    try:
        load_decode_kernel(_kernel_root(cache_dir))
    except KernelBuildError as e:
        if not _decode_warned:
            logger.warning("fused CPU decode attention unavailable, decoding on the torch path: %s", e)
            _decode_warned = True
        return False
    return True
