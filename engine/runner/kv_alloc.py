"""The KV pool's tensors: dense in the cache dtype, or 8-bit values with per-token, per-head scales."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.runner.loader import ModelConfig
from kernels.kv_quant import QUANT_DTYPES, QuantizedKV, bytes_per_token_head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KVCaches = list[tuple[torch.Tensor | QuantizedKV, torch.Tensor | QuantizedKV]]


def kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dense cache dtype, or for an 8-bit cache the dtype of its values."""
    if config.kv_cache_dtype in QUANT_DTYPES:
        return QUANT_DTYPES[config.kv_cache_dtype]
    if config.kv_cache_dtype != "auto":
        return DTYPES[config.kv_cache_dtype]
    if device.type == "cpu":  # the fused decode kernel reads float32 and bfloat16 caches (not float16)
        return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return dtype


def bytes_per_block(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one block over every layer, scales included."""
    if config.kv_cache_dtype in QUANT_DTYPES:
        per_head = bytes_per_token_head(config.kv_cache_dtype, mc.head_dim)
    else:
        per_head = mc.head_dim * dtype.itemsize
    return 2 * mc.num_layers * config.block_size * mc.num_kv_heads * per_head


def check_kv_dtype(config: EngineConfig, device: torch.device) -> None:
    """fp8 needs e4m3 arithmetic in Triton on CUDA: compute capability 8.9 (Ada, Hopper) and up."""
    if config.kv_cache_dtype == "fp8" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ModelLoadError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer; this "
                                 f"one is {major}.{minor} (use 'int8')")


def allocate_kv_caches(config: EngineConfig, shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                       compute_dtype: torch.dtype, device: torch.device) -> KVCaches:
    """Zeroed, not empty: a fresh pool must never expose memory this process used for something else."""
    if config.kv_cache_dtype in QUANT_DTYPES:
        return [(QuantizedKV.zeros(shape, config.kv_cache_dtype, compute_dtype, device),
                 QuantizedKV.zeros(shape, config.kv_cache_dtype, compute_dtype, device))
                for _ in range(num_layers)]
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def pool_nbytes(kv_caches: KVCaches) -> int:
    return sum(c.nbytes() if isinstance(c, QuantizedKV) else c.numel() * c.element_size()
               for pair in kv_caches for c in pair)
