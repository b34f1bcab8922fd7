"""Paged attention over a block-table KV cache: decode (batched) and prefill (per sequence, causal)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels.cpu_ext import decode_kernel_loaded, paged_attention_rows, paged_decode_attention
from kernels.kv_quant import QuantizedKV, dense_blocks, dense_view, gather_slots


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
class DecodeGroup:
    """Decode rows [start, end) of the batch, with similar context lengths so padding stays small.

    ``block_tables`` [g, nb] lists each row's blocks (padded with the null block, which is never allocated
    and stays zero); ``mask`` [g, 1, 1, nb * bs] marks real context slots (None when every row fills all
    nb blocks exactly).
    """

    start: int
    end: int
    block_tables: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class InvariantRows:
    """Batch tokens [start, T) of batch-invariant sequences: each row attends to keys [0, row_ctx) of
    block table ``row_seq`` through a row-wise kernel (C++ on the CPU, Triton on CUDA), which computes
    every row the same way whatever the batch, so prefill and decode rows (and cached and recomputed
    prefixes) agree bit for bit."""

    start: int
    block_tables: torch.Tensor  # [S, max_blocks] int64
    row_seq: torch.Tensor  # [R] int64
    row_ctx: torch.Tensor  # [R] int64
    backend: str = "cpp"  # or "triton" (kernels.triton_bi)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout shared by every layer.

    Token layout of the flattened batch (decodes first, then prefill chunks)::

        | d0 d1 ... d{D-1} | p0 p0 p0 ... | p1 p1 ... |
          one token each     span 0         span 1

    ``slot_mapping[t]`` is where token t's K/V are written. On the CPU the fused C++ kernel reads every
    decode row's blocks in place (``decode_rows``: all rows' tables and context lengths, derived from the
    groups once per step and shared by the layers). Elsewhere decode rows come in groups of similar
    context length; each group gathers whole blocks (contiguous block_size x heads x dim chunks, far
    cheaper than per-token gathers) and masks the padding.
    """

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    invariant: InvariantRows | None = None
    linear_plan: Any = None  # engine.determinism.TilePlan | TritonPlan (batch-invariant steps)
    decode_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # [D, max_blocks], [D] int64; on first use
    # A block that padding rows of a CUDA-graph decode step write and read (the pool's null block): zeroed
    # again after each layer's attention, so it reads as zeros to every other kernel.
    scratch_block: int | None = None
    prefill_plan: Any = None  # kernels.triton_prefill.PrefillPlan on CUDA; built on first use


_workspace: dict[tuple, torch.Tensor] = {}


def _gather_blocks(cache: torch.Tensor | QuantizedKV, block_ids: torch.Tensor, which: int) -> torch.Tensor:
    """cache[block_ids] into a reused buffer: fresh multi-MiB allocations per layer cost page faults."""
    if isinstance(cache, QuantizedKV):
        return dense_blocks(cache, block_ids)
    n = block_ids.numel()
    # inference-mode tensors cannot be written outside inference mode: keep one buffer per mode
    key = (which, cache.dtype, cache.device, cache.shape[1:], torch.is_inference_mode_enabled())
    buf = _workspace.get(key)
    if buf is None or buf.shape[0] < n:
        buf = _workspace[key] = torch.empty((max(n, 64), *cache.shape[1:]), dtype=cache.dtype,
                                            device=cache.device)
    return torch.index_select(cache, 0, block_ids, out=buf[:n])


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                  scale: float) -> torch.Tensor:
    # q: [g, Hkv, G, Dh]; grouped query heads ride in the "query length" dim, so GQA needs no K/V
    # expansion, and one query per sequence needs no causal mask.
    g, num_blocks = group.block_tables.shape
    bs, num_kv_heads, head_dim = k_cache.shape[1:]
    flat = group.block_tables.reshape(-1)
    k = _gather_blocks(k_cache, flat, 0).view(g, num_blocks * bs, num_kv_heads, head_dim)
    v = _gather_blocks(v_cache, flat, 1).view(g, num_blocks * bs, num_kv_heads, head_dim)
    if group.mask is not None:
        # Slots past a row's context get probability 0, but 0 * inf is NaN: the tail of a row's last block
        # still holds whatever its previous owner wrote there, so zero those values before the product.
        v.masked_fill_(~group.mask[:, 0, 0, :, None, None], 0)
    out = torch.empty(g, num_kv_heads, q.shape[2], head_dim, dtype=k.dtype, device=k.device)
    q = q.to(k.dtype)
    # One bmm pair per KV head on strided views: BLAS reads the [g, L, Dh] head slices in place, where a
    # permute to [g, Hkv, L, Dh] would copy all of K and V every layer.
    for h in range(num_kv_heads):
        scores = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)).float() * scale  # [g, G, L]
        if group.mask is not None:
            scores.masked_fill_(~group.mask[:, 0], float("-inf"))
        out[:, h] = torch.bmm(torch.softmax(scores, dim=-1).to(k.dtype), v[:, :, h])
    return out  # [g, Hkv, G, Dh]


def decode_rows(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decode row's block table (the padding between groups is never read: these kernels stop at
    each row's context length) and context length."""
    if meta.decode_rows is None:
        groups = meta.decode_groups
        width = max(g.block_tables.shape[1] for g in groups)
        tables = torch.cat([F.pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups])
        # a group's mask is True on the first ctx_len slots of each row; no mask: every row fills nb blocks
        lens = torch.cat([g.mask[:, 0, 0].sum(-1) if g.mask is not None else
                          torch.full((g.end - g.start,), g.block_tables.shape[1] * block_size,
                                     dtype=torch.long, device=g.block_tables.device) for g in groups])
        meta.decode_rows = (tables, lens)
    return meta.decode_rows


def _can_fuse_decode(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    fusable = (torch.float32, torch.bfloat16)
    return (k_cache.device.type == "cpu" and k_cache.dtype in fusable and query.dtype in fusable
            and decode_kernel_loaded())


def _decode_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor) -> None:
    """Decode rows group by group: gather, then per-KV-head bmm/softmax/bmm (CUDA, and the CPU fallback)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[-2]
    for dg in meta.decode_groups:
        q = query[dg.start:dg.end].view(dg.end - dg.start, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out[dg.start:dg.end] = _decode_group(q, k_cache, v_cache, dg, scale).reshape(-1, num_heads, head_dim)


def _decode_fused(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor) -> None:
    """All decode rows in one call of the C++ kernel, K/V read in place."""
    tables, lens = decode_rows(meta, k_cache.shape[1])
    n = meta.num_decode_tokens
    out[:n] = paged_decode_attention(query[:n], k_cache, v_cache, tables, lens, scale)


def prefill_torch(query: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                  v_cache: torch.Tensor | QuantizedKV, meta: AttentionMetadata, scale: float,
                  out: torch.Tensor) -> None:
    """Chunk by chunk: gather the context (dequantized if 8-bit), then SDPA (the CPU's path). A bfloat16
    cache on the CPU is read in float32, as the fused decode kernel reads it: a bfloat16 model's K/V are
    bfloat16 values either way, and a token's attention then does not depend on whether it ran in a
    prefill chunk or a decode step (bfloat16 SDPA rounds the probabilities to bfloat16)."""
    group = query.shape[1] // k_cache.shape[-2]
    widen = query.device.type == "cpu" and compute_dtype(k_cache) == torch.bfloat16
    dtype = torch.float32 if widen else out.dtype
    for span in meta.prefills:
        s, n = span.q_start, span.q_len
        q = query[s:s + n].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, H, n, Dh]
        k = gather_slots(k_cache, span.ctx_slots).transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Hkv, L, Dh]
        v = gather_slots(v_cache, span.ctx_slots).transpose(0, 1).unsqueeze(0).to(dtype)
        if span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale,
                                               enable_gqa=group > 1)
        out[s:s + n] = o[0].transpose(0, 1)


def _prefill_triton(query: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                    v_cache: torch.Tensor | QuantizedKV, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor) -> None:
    """Every prefill chunk in one launch of the paged Triton kernel (``kernels.triton_prefill``)."""
    from kernels.triton_prefill import PrefillPlan, prefill_attention

    if meta.prefill_plan is None:
        meta.prefill_plan = PrefillPlan.build(meta.prefills, query.device)
    prefill_attention(query, k_cache, v_cache, meta.prefill_plan, scale, out)


def _decode_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, out: torch.Tensor) -> None:
    """All decode rows through the split-KV Triton kernel (``kernels.triton_decode``: each row's context
    cut into spans read by separate programs, then merged), K/V read in place through the block table.
    The split count follows the row count only, so a CUDA graph of a batch size keeps its grid."""
    from kernels.triton_decode import pick_num_splits, split_decode_attention

    tables, lens = decode_rows(meta, k_cache.shape[1])
    n = meta.num_decode_tokens
    splits = pick_num_splits(n, k_cache.shape[2], num_sms(query.device))
    out[:n] = split_decode_attention(query[:n], k_cache, v_cache, tables, lens, scale, splits)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The GPU's SM count; 1 elsewhere (Triton's interpreter on CPU tensors, in tests)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_kernel(query: torch.Tensor, k_cache: torch.Tensor):
    """The decode path for this device: the fused C++ kernel on the CPU, the Triton one on CUDA, else
    torch's."""
    if _can_fuse_decode(query, k_cache):
        return _decode_fused
    if k_cache.device.type == "cuda" and has_triton():
        return _decode_triton
    return _decode_torch


@functools.cache
def has_triton() -> bool:
    """Whether Triton can be imported here (the GPU kernels' compiler); asked once per process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compute_dtype(cache: torch.Tensor | QuantizedKV) -> torch.dtype:
    """The dtype attention over this cache runs in: the cache's own, or what an 8-bit one dequantizes to."""
    return cache.compute_dtype if isinstance(cache, QuantizedKV) else cache.dtype


def zero_block(cache: torch.Tensor | QuantizedKV, block: int) -> None:
    if isinstance(cache, QuantizedKV):
        cache.raw()[block].zero_()
        cache.scale[block].zero_()
    else:
        cache[block].zero_()


def _invariant_rows(query: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                    v_cache: torch.Tensor | QuantizedKV, inv: InvariantRows, scale: float) -> torch.Tensor:
    rows_kernel = paged_attention_rows
    if inv.backend == "triton":
        from kernels.triton_bi import paged_attention_rows_triton as rows_kernel
    tables = inv.block_tables
    if isinstance(k_cache, QuantizedKV):  # the rows kernels read dense caches: just the blocks they need
        k_cache, v_cache, tables = dense_view(k_cache, v_cache, tables)
    elif inv.backend == "cpp" and k_cache.dtype == torch.bfloat16:  # the C++ one reads float32: widen them
        ids, inverse = torch.unique(tables, return_inverse=True)
        k_cache, v_cache, tables = k_cache[ids].float(), v_cache[ids].float(), inverse.view_as(tables)
    return rows_kernel(query[inv.start:].to(k_cache.dtype), k_cache, v_cache, tables, inv.row_seq,
                       inv.row_ctx, scale)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                    v_cache: torch.Tensor | QuantizedKV, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of every batch token over its sequence's cached context.

    Args:
        query: [T, num_heads, head_dim], RoPE applied. The cache may hold another dtype than the query
            (float32 K/V under a bfloat16 model); the fused CPU decode kernel accumulates in float32,
            the torch paths run in the cache's dtype.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V already stored;
            dense, or 8-bit ``QuantizedKV`` caches (dequantized to their compute dtype as they are read).
        meta: the step's layout.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [T, num_heads * head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(query.shape, dtype=compute_dtype(k_cache), device=query.device)
    if meta.decode_groups:
        _decode_kernel(query, k_cache)(query, k_cache, v_cache, meta, scale, out)
        if meta.scratch_block is not None:
            zero_block(k_cache, meta.scratch_block)
            zero_block(v_cache, meta.scratch_block)
    if meta.prefills:
        on_gpu = query.device.type == "cuda" and has_triton()
        (_prefill_triton if on_gpu else prefill_torch)(query, k_cache, v_cache, meta, scale, out)
    if meta.invariant is not None:
        out[meta.invariant.start:] = _invariant_rows(query, k_cache, v_cache, meta.invariant, scale)
    return out.view(num_tokens, num_heads * head_dim).to(query.dtype)
