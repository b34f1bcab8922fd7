"""Loop-based pure-torch references for the kernels: slow and obvious, for tests only."""

from __future__ import annotations

import torch


def ref_store_kv(key, value, k_cache, v_cache, block_tables: list[list[int]], positions: list[int],
                 seq_of_token: list[int]) -> None:
    """Write token t's K/V at (block_tables[seq][pos // bs], pos % bs), one token at a time."""
    block_size = k_cache.shape[1]
    for t, (seq, pos) in enumerate(zip(seq_of_token, positions, strict=True)):
        block = block_tables[seq][pos // block_size]
        k_cache[block, pos % block_size] = key[t]
        v_cache[block, pos % block_size] = value[t]


def ref_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: list[int], context_len: int, scale: float) -> torch.Tensor:
    """Causal attention of ``q_len`` queries (the last positions of the context) for one sequence.

    Args:
        query: [q_len, num_heads, head_dim].
        block_table: the sequence's block ids, in order.
        context_len: tokens of context, including the q_len new ones.

    Returns:
        [q_len, num_heads, head_dim] in float32.
    """
    q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = torch.stack([k_cache[block_table[p // block_size], p % block_size] for p in range(context_len)])
    values = torch.stack([v_cache[block_table[p // block_size], p % block_size] for p in range(context_len)])
    out = torch.empty(q_len, num_heads, head_dim, dtype=torch.float32)
    for i in range(q_len):
        pos = context_len - q_len + i
        for h in range(num_heads):
            kh = keys[: pos + 1, h // group].float()
            vh = values[: pos + 1, h // group].float()
            scores = (kh @ query[i, h].float()) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ vh
    return out


def ref_paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: list[list[int]], context_lens: list[int],
                               scale: float) -> torch.Tensor:
    """One decode token per row: row b attends to keys [0, context_lens[b]) of ``block_tables[b]``.

    Args:
        query: [B, num_heads, head_dim].
        block_tables: each row's block ids, in order (entries past the context are ignored).

    Returns:
        [B, num_heads, head_dim] in float32.
    """
    rows = [ref_paged_attention(query[b:b + 1], k_cache, v_cache, block_tables[b], context_lens[b], scale)
            for b in range(query.shape[0])]
    return torch.cat(rows) if rows else torch.empty(query.shape, dtype=torch.float32)
