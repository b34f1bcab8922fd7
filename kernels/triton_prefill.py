"""Paged prefill attention in Triton: every prefill chunk of a step in one launch, K/V read in place.

The torch path gathers each chunk's whole context into a fresh tensor and runs SDPA on it, a handful of
launches per chunk and layer, with the chunk's causal mask built on the host. Here a program takes
``BLOCK_M`` query tokens of one chunk for one query head and walks that chunk's context ``BLOCK_N``
tokens at a time through its flat slot list (the slots ``PrefillSpan.ctx_slots`` already holds), with an
online softmax; keys past a query's own position are masked, so a chunk that continues a cached prefix
attends to the prefix and causally to itself. The launch grid is (query tiles of all chunks, query
heads); a small host-built table maps each tile to its chunk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_quant import QuantizedKV
from kernels.triton_decode import to_f16

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 64  # query tokens a program takes
BLOCK_N = 64  # context tokens per step of its loop


@dataclass(slots=True)
class PrefillPlan:
    """The step's chunks for the kernel, built once per step and shared by the layers.

    tiles: [num_tiles * 2] int32, per tile (chunk, first query of the tile within the chunk).
    spans: [num_chunks * 4] int32, per chunk (first batch token, query count, context length, index of
        its first slot in ``slots``).
    slots: [sum of context lengths] int64, every chunk's context slots one after another.
    """

    tiles: torch.Tensor
    spans: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def build(cls, prefills: list, device: torch.device) -> PrefillPlan:
        tiles, spans, first_slot = [], [], 0
        for i, p in enumerate(prefills):
            ctx = p.ctx_slots.shape[0]
            spans.append((p.q_start, p.q_len, ctx, first_slot))
            tiles += [(i, m) for m in range(0, p.q_len, BLOCK_M)]
            first_slot += ctx
        slots = torch.cat([p.ctx_slots for p in prefills])
        flat = [x for t in tiles for x in t] + [x for s in spans for x in s]
        meta = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)  # one copy
        return cls(meta[:2 * len(tiles)], meta[2 * len(tiles):], slots)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, tiles_ptr, spans_ptr, o_ptr, scale,
                    sqt, sqh, skt, skh, sst, sot, soh,
                    GROUP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr, F16: tl.constexpr,
                    IS_INT8: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    chunk = tl.load(tiles_ptr + 2 * pid)
    m0 = tl.load(tiles_ptr + 2 * pid + 1)
    q_start = tl.load(spans_ptr + 4 * chunk)
    q_len = tl.load(spans_ptr + 4 * chunk + 1)
    ctx = tl.load(spans_ptr + 4 * chunk + 2)
    first_slot = tl.load(spans_ptr + 4 * chunk + 3).to(tl.int64)
    kvh = h // GROUP
    d = tl.arange(0, D_P2)
    d_ok = d < D
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    pos_m = ctx - q_len + offs_m  # each query's position in its sequence: it sees keys [0, pos]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * sqt + h * sqh + d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    if F16:
        q = q.to(tl.float16)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D_P2), dtype=tl.float32)
    hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # the tile's last query sees keys below this
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slot = tl.load(slots_ptr + first_slot + offs_n, mask=n_ok, other=0)
        kv_off = slot * skt + kvh * skh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if F16:
            k = to_f16(k, IS_INT8)
            v = to_f16(v, IS_INT8)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if QUANT:
            sc_off = slot * sst + kvh
            s = s * tl.load(ks_ptr + sc_off, mask=n_ok, other=0.0)[None, :]
        seen = n_ok[None, :] & (offs_n[None, :] <= pos_m[:, None])
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * tl.load(vs_ptr + sc_off, mask=n_ok, other=0.0)[None, :]
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * sot + h * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                      v_cache: torch.Tensor | QuantizedKV, plan: PrefillPlan, scale: float,
                      out: torch.Tensor) -> None:
    """Causal attention of every prefill chunk's queries over its context, written into ``out``.

    Args:
        query: [T, num_heads, head_dim], the step's tokens (the chunks' rows among them).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], dense or 8-bit, with this
            step's K/V already stored.
        plan: the step's ``PrefillPlan``.
        scale: softmax scale.
        out: [T, num_heads, head_dim]; only the chunks' rows are written.
    """
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    quant = isinstance(k_cache, QuantizedKV)
    kc, vc = (k_cache.data, v_cache.data) if quant else (k_cache, v_cache)
    ks, vs = (k_cache.scale, v_cache.scale) if quant else (kc, vc)  # unread unless quantized
    if not kc.is_contiguous() or not vc.is_contiguous() or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("prefill_attention needs contiguous caches and a contiguous last dimension")
    query = query.to(out.dtype)
    ieee = out.dtype == torch.float32 or _INTERPRETED
    _prefill_kernel[(plan.tiles.shape[0] // 2, num_heads)](
        query, kc, vc, ks, vs, plan.slots, plan.tiles, plan.spans, out, scale,
        query.stride(0), query.stride(1), num_kv_heads * head_dim, head_dim, num_kv_heads,
        out.stride(0), out.stride(1), GROUP=num_heads // num_kv_heads, D=head_dim,
        D_P2=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=ieee,
        QUANT=quant, F16=quant and not ieee, IS_INT8=kc.dtype == torch.int8, num_warps=4)
