"""K/V slot writes into the paged cache."""

from __future__ import annotations

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V into its slot.

    Args:
        key, value: [T, num_kv_heads, head_dim] for the T tokens of this step.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping: [T] int64; slot = block_id * block_size + offset in block.
    """
    assert key.shape == value.shape and key.shape[0] == slot_mapping.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
