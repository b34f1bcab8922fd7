"""K/V slot writes into the paged cache."""

from __future__ import annotations

import functools

import torch

from kernels.kv_quant import QuantizedKV, store_quantized


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
             v_cache: torch.Tensor | QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V into its slot (quantized to 8 bits where the cache is a ``QuantizedKV``).

    Args:
        key, value: [T, num_kv_heads, head_dim] for the T tokens of this step.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping: [T] int64; slot = block_id * block_size + offset in block.
    """
    assert key.shape == value.shape and key.shape[0] == slot_mapping.shape[0]
    if k_cache.device.type == "cuda" and _triton_store() is not None:
        _triton_store()(key, value, k_cache, v_cache, slot_mapping)
    elif isinstance(k_cache, QuantizedKV):
        store_quantized(key, value, k_cache, v_cache, slot_mapping)
    else:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@functools.cache
def _triton_store():
    """``kernels.triton_kv.store_kv_triton`` where Triton imports, else None."""
    try:
        from kernels.triton_kv import store_kv_triton
    except ImportError:
        return None
    return store_kv_triton
