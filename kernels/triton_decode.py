"""Split-KV (flash-decoding) paged decode attention in Triton: the fast path's decode on CUDA.

The rows kernel (``kernels.triton_bi``) gives each (row, KV head) one program that walks the row's
blocks in order: at 64 rows of a 3-KV-head model that is 192 programs, too few to keep an H100's 132 SMs
streaming, and it stopped near 250 GB/s. Here each (row, KV head) is cut into ``num_splits`` spans of
its context, each span a program that reads ``TILE`` tokens per step (gathered through the block table,
several blocks at once) and keeps an online softmax; a second kernel merges the spans' partial results
by their log-sum-exp. The grid depends only on the row count and ``num_splits``, never on the context
lengths (each program finds its span from its row's length), so a CUDA graph captured once serves every
step of that batch size.

Not batch-invariant: a row's result depends on ``num_splits``, which the caller picks from the batch
size. ``batch_invariant`` mode keeps the rows kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_quant import QuantizedKV

# The interpreter runs tl.dot on numpy arrays, which have no bfloat16: there every product is float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TILE = 128  # tokens a program reads per step: eight 16-token blocks
MIN_SPLIT_TOKENS = 256  # a span never holds fewer tokens, so short contexts do not pay for empty splits
MAX_SPLITS = 16
STAGES = 2  # software pipeline depth of the span loop


@triton.jit
def _split_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, ctx_ptr, o_ptr, lse_ptr, scale,
                         sqr, sqh, skb, sks, skh, ssb, sss, st, sor, soh, sos, slr, slh,
                         GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                         BS: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         MIN_SPAN: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
                         STAGES: tl.constexpr, F16: tl.constexpr, IS_INT8: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + r)
    # span of this program: whole tiles, at least MIN_SPAN tokens, the same arithmetic in every program
    span = tl.maximum(tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), TILE) * TILE, MIN_SPAN)
    start = sp * span
    end = tl.minimum(start + span, ctx)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, D_P2)
    g_ok = g < GROUP
    d_ok = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + r * sqr + heads[:, None] * sqh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    if F16:
        q = q.to(tl.float16)
    m_i = tl.full((GROUP_P2,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_P2,), dtype=tl.float32)
    acc = tl.zeros((GROUP_P2, D_P2), dtype=tl.float32)
    offs = tl.arange(0, TILE)
    for t0 in tl.range(start, end, TILE, num_stages=STAGES):
        t = t0 + offs
        ok = t < end
        block = tl.load(tables_ptr + r * st + t // BS, mask=ok, other=0).to(tl.int64)
        kv_off = block * skb + (t % BS) * sks + kvh * skh
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE, D]
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if F16:
            k = to_f16(k, IS_INT8)
            v = to_f16(v, IS_INT8)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [G, TILE], float32 accumulation
        if QUANT:  # 8-bit K/V: each token's scale multiplies its score column and its probability
            sc_off = block * ssb + (t % BS) * sss + kvh
            s = s * tl.load(ks_ptr + sc_off, mask=ok, other=0.0)[None, :]
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * tl.load(vs_ptr + sc_off, mask=ok, other=0.0)[None, :]
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # an empty span (start >= ctx) leaves l_i = 0: its log-sum-exp is -inf and it weighs nothing
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + r * sor + heads[:, None] * soh + sp * sos + d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + r * slr + heads * slh + sp, lse, mask=g_ok)


@triton.jit
def to_f16(x, IS_INT8: tl.constexpr):
    """8-bit values to float16 for the dot. int8 by the magic-number trick (x + 1152 as float16 bits of
    1024 + (x + 128), less 1152: integer adds instead of int-to-float conversions, whose throughput
    bound the kernel); e4m3 by the hardware's packed conversion."""
    if IS_INT8:
        return (x.to(tl.int16) + 0x6480).to(tl.uint16).to(tl.float16, bitcast=True) - 1152.0
    return x.to(tl.float16)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, o_ptr, spr, sph, sps, slr, slh, sor, soh,
                  NUM_SPLITS: tl.constexpr, S_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_P2)
    d = tl.arange(0, D_P2)
    s_ok = s < NUM_SPLITS
    lse = tl.load(lse_ptr + r * slr + h * slh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no context at all: zeros, not NaN
    w = tl.exp(lse - top)  # [S]
    part = tl.load(part_ptr + r * spr + h * sph + s[:, None] * sps + d[None, :],
                   mask=s_ok[:, None] & (d[None, :] < D), other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + r * sor + h * soh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


def pick_num_splits(rows: int, num_kv_heads: int, num_sms: int) -> int:
    """Spans per (row, KV head) so that the grid holds about four programs per SM (a power of two, at
    most ``MAX_SPLITS``); each span still holds at least ``MIN_SPLIT_TOKENS``. On an H200 (132 SMs),
    2026-11-26, timed in CUDA graphs: 8 splits of 32 rows x 4k tokens read 3114 GB/s where 16 read 2885;
    at 256 rows x 4k, 1 split 4017 and 2 splits 3964; at 64 x 8k, 4 and 8 splits within 1%."""
    want = max(1, -(-4 * num_sms // max(1, rows * num_kv_heads)))
    return min(MAX_SPLITS, triton.next_power_of_2(want))


def split_decode_attention(query: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                           v_cache: torch.Tensor | QuantizedKV, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float, num_splits: int, tile: int = TILE,
                           num_warps: int = 4, stages: int = STAGES, f16: bool = True) -> torch.Tensor:
    """One decode query per row over its paged context, split across ``num_splits`` programs per row
    and KV head.

    Args:
        query: [R, num_heads, head_dim].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] dense tensors, or 8-bit
            ``QuantizedKV`` caches (read in 8 bits; their scales fold into scores and probabilities).
        block_tables: [R, max_blocks] int (row i's blocks; entries past its context are not read).
        ctx_lens: [R] int, each row's context length (0 gives a zero row).
        scale: softmax scale.
        num_splits: spans per row and KV head (``pick_num_splits``).
        tile, num_warps, stages: tokens a program reads per step, its warps and its loop's software
            pipeline depth (the defaults are the engine's; `kvgate bench gpu` times others).
        f16: an 8-bit cache's products in float16 (its values convert to float16 cheaply) rather than
            in the compute dtype; not used for float32 or dense caches.

    Returns:
        [R, num_heads, head_dim] in the cache's dtype (the compute dtype of an 8-bit cache), float32
        arithmetic inside.
    """
    rows, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads or block_size & (block_size - 1):
        raise ValueError("heads must divide evenly and block_size must be a power of two")
    quant = isinstance(k_cache, QuantizedKV)
    kc, vc = (k_cache.data, v_cache.data) if quant else (k_cache, v_cache)
    ks, vs = (k_cache.scale, v_cache.scale) if quant else (kc, vc)  # unread unless quantized
    if kc.stride(-1) != 1 or block_tables.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("the last dimension of query, caches and block tables must be contiguous")
    out_dtype = k_cache.compute_dtype if quant else kc.dtype
    query = query.to(out_dtype)
    out = torch.empty((rows, num_heads, head_dim), dtype=out_dtype, device=query.device)
    if rows == 0:
        return out
    part = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=query.device)
    d_p2 = triton.next_power_of_2(head_dim)
    ieee = out_dtype == torch.float32 or _INTERPRETED
    # tl.dot needs at least 16 rows: the group's query heads are padded (compute is not what binds here)
    _split_decode_kernel[(rows, num_kv_heads, num_splits)](
        query, kc, vc, ks, vs, block_tables, ctx_lens, part, lse, scale,
        query.stride(0), query.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_P2=max(16, triton.next_power_of_2(group)), D=head_dim, D_P2=max(16, d_p2),
        BS=block_size, TILE=tile, NUM_SPLITS=num_splits, MIN_SPAN=max(MIN_SPLIT_TOKENS, tile),
        IEEE=ieee, QUANT=quant, STAGES=stages, F16=quant and f16 and not ieee,
        IS_INT8=kc.dtype == torch.int8, num_warps=num_warps)
    _merge_kernel[(rows, num_heads)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
        S_P2=max(2, triton.next_power_of_2(num_splits)), D=head_dim, D_P2=d_p2)
    return out
