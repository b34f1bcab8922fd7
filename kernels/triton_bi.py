"""Batch-invariant Triton kernels (the GPU path of ``batch_invariant`` mode).

Three ops decide whether a row's bits depend on what else is in the batch; each is written so they do not:

- ``bi_linear``: a matmul with one fixed tile configuration whatever the row count (no autotuning, no
  split-K): every output element sums its K blocks in the same order in the same kind of program.
- ``bi_rms_norm``: one program per row, the whole row in one block.
- ``paged_attention_rows_triton``: one program per (query row, KV head), keys visited one cache block at a
  time from position 0 with an online softmax: prefill and decode rows, cached and recomputed prefixes
  all take the same path (one KV layout, a fixed split size).

Importing this module needs ``triton``. Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU
tensors (how the tests check them); set it before this module is first imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# One configuration for every call: changing it changes the bits (and the system fingerprint). The
# interpreter pays per program, so there the tiles are wider (same code, other tile shape), and its
# products are a broadcast multiply and sum: it runs ``tl.dot`` as numpy's matmul, whose BLAS may round a
# row differently depending on its position in the tile (OpenBLAS 0.3.31 does), which a GPU's dot does not.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = (64, 512, 32, 4) if _INTERPRETED else (64, 64, 32, 4)
CONFIG = f"triton-mm{BLOCK_M}x{BLOCK_N}x{BLOCK_K}w{NUM_WARPS}" + ("-interpreted" if _INTERPRETED else "")


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, sxm, sxk, swn, swk, som, son,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if INTERPRETED:  # every row summed in the same order, wherever it sits in the tile
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D ``x`` with row results independent of the row count.
    float32 inputs use IEEE float32 products (no TF32)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, k,
                         x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
                         out.stride(0), out.stride(1),
                         HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, INTERPRETED=_INTERPRETED,
                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, N, sx, so, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(o_ptr + row * so + cols, (w * normed).to(o_ptr.dtype.element_ty), mask=mask)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it (float32 statistics, cast back before the weight), one
    program per row."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.shape[1], x2.stride(0), out.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape)


@triton.jit
def _rows_attention_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_ptr, ctx_ptr, o_ptr, scale,
                           sqr, sqh, skb, sks, skh, st, sor, soh,
                           GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                           BS: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(seq_ptr + r)
    ctx = tl.load(ctx_ptr + r)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, D_P2)
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + r * sqr + heads[:, None] * sqh + d[None, :], mask=gd_mask, other=0.0).to(tl.float32)
    m_i = tl.full((GROUP_P2,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_P2,), dtype=tl.float32)
    acc = tl.zeros((GROUP_P2, D_P2), dtype=tl.float32)
    offs = tl.arange(0, BS)
    for b in range(0, tl.cdiv(ctx, BS)):
        block = tl.load(tables_ptr + seq * st + b)
        pos_ok = b * BS + offs < ctx
        kv_off = block * skb + offs[:, None] * sks + kvh * skh + d[None, :]
        kv_mask = pos_ok[:, None] & (d[None, :] < D)
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)  # [BS, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BS]
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + r * sor + heads[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=gd_mask)


def paged_attention_rows_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, row_seq: torch.Tensor, row_ctx: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """The Triton twin of ``kernels.cpu_ext.paged_attention_rows`` (same arguments and result); any cache
    dtype, float32 arithmetic, output in the cache's dtype."""
    rows, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads or block_size & (block_size - 1):
        raise ValueError("heads must divide evenly and block_size must be a power of two")
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty(query.shape, dtype=k_cache.dtype, device=query.device)
    if rows:
        _rows_attention_kernel[(rows, num_kv_heads)](
            query, k_cache, v_cache, block_tables, row_seq, row_ctx, out, scale,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=head_dim,
            D_P2=triton.next_power_of_2(head_dim), BS=block_size)
    return out
