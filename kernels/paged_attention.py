"""Paged attention over a block-table KV cache: decode (batched) and prefill (per sequence, causal)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk inside the flattened token batch.

    Its queries are batch tokens [q_start, q_start + q_len); they attend to ``ctx_slots``, the flat cache
    slots of every context token (cached prefix, earlier chunks, then this chunk), so the last ``q_len``
    context positions are the chunk itself.
    """

    q_start: int
    q_len: int
    ctx_slots: torch.Tensor  # [ctx_len] int64
    mask: torch.Tensor | None  # [q_len, ctx_len] bool (True = attend), None when ctx_len == q_len


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout shared by every layer.

    Token layout of the flattened batch (decodes first, then prefill chunks)::

        | d0 d1 ... d{D-1} | p0 p0 p0 ... | p1 p1 ... |
          one token each     span 0         span 1

    ``slot_mapping[t]`` is where token t's K/V are written. Decode sequence i reads its context from
    ``decode_slots[i, :context_len_i]``; the rest of the row is padding masked off by ``decode_mask``.
    """

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_slots: torch.Tensor | None  # [D, L] int64
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] bool, None when no row is padded
    prefills: list[PrefillSpan]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    num_kv_heads, head_dim = cache.shape[-2:]
    return cache.view(-1, num_kv_heads, head_dim)[slots]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of every batch token over its sequence's cached context.

    Args:
        query: [T, num_heads, head_dim], RoPE applied.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V already stored.
        meta: the step's layout.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [T, num_heads * head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    d = meta.num_decode_tokens
    if d:
        # Grouped query heads ride in the "query length" dim: q [D, Hkv, G, Dh] against k [D, Hkv, L, Dh],
        # so GQA needs no K/V expansion. Decode has one query per sequence, so no causal mask is needed.
        q = query[:d].view(d, num_kv_heads, group, head_dim)
        k = _gather(k_cache, meta.decode_slots).transpose(1, 2)
        v = _gather(v_cache, meta.decode_slots).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:d] = o.reshape(d, num_heads, head_dim)
    for span in meta.prefills:
        s, n = span.q_start, span.q_len
        q = query[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
        k = _gather(k_cache, span.ctx_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, Dh]
        v = _gather(v_cache, span.ctx_slots).transpose(0, 1).unsqueeze(0)
        if span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale,
                                               enable_gqa=group > 1)
        out[s:s + n] = o[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
