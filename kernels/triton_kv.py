"""The KV write on CUDA in Triton: each new token's K and V into its cache slot in one launch, quantized
to 8 bits with a scale per token and KV head where the cache is a ``QuantizedKV``.

Two ``index_copy_`` launches (plus a cast each) per layer did this before; an 8-bit cache would add an
absolute-max reduction, a division and a rounding per tensor on top.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import QuantizedKV


@triton.jit
def _store_one(src_ptr, st, sh, cache_ptr, scale_ptr, t, slot, sslot, sshead,
               H: tl.constexpr, H_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
               QUANT: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr):
    h = tl.arange(0, H_P2)
    d = tl.arange(0, D_P2)
    mask = (h[:, None] < H) & (d[None, :] < D)
    dst = slot * sslot + h[:, None] * sshead + d[None, :]
    x = tl.load(src_ptr + t * st + h[:, None] * sh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        scale = tl.max(tl.abs(x), axis=1) / QMAX  # [H_P2]
        inv = tl.where(scale > 0, 1.0 / tl.where(scale > 0, scale, 1.0), 0.0)
        q = x * inv[:, None]
        if IS_INT8:
            # half away from zero, as kernels.kv_quant.quantize rounds (the cast alone would truncate)
            q = tl.minimum(tl.maximum(tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(0.5 - q)), -127.0), 127.0)
        tl.store(cache_ptr + dst, q.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + slot * H + h, scale, mask=h < H)
    else:
        tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                    skt, skh, svt, svh, sslot, sshead,
                    H: tl.constexpr, H_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                    QUANT: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    _store_one(k_ptr, skt, skh, kc_ptr, ks_ptr, t, slot, sslot, sshead, H, H_P2, D, D_P2,
               QUANT, IS_INT8, QMAX)
    _store_one(v_ptr, svt, svh, vc_ptr, vs_ptr, t, slot, sslot, sshead, H, H_P2, D, D_P2,
               QUANT, IS_INT8, QMAX)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                    v_cache: torch.Tensor | QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """``kernels.store_kv`` in one Triton launch.

    Args:
        key, value: [T, num_kv_heads, head_dim], last dimension contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] dense tensors, or 8-bit
            ``QuantizedKV`` caches (both of one kind).
        slot_mapping: [T] int64.
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quant = isinstance(k_cache, QuantizedKV)
    kc, vc = (k_cache.data, v_cache.data) if quant else (k_cache, v_cache)
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not kc.is_contiguous() or not vc.is_contiguous():
        raise ValueError("store_kv_triton needs contiguous caches and a contiguous last dimension")
    ks, vs = (k_cache.scale, v_cache.scale) if quant else (kc, vc)  # unused pointers when not quantized
    store_kv_kernel[(num_tokens,)](
        key, value, kc, vc, ks, vs, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), num_heads * head_dim, head_dim, H=num_heads,
        H_P2=triton.next_power_of_2(num_heads), D=head_dim, D_P2=triton.next_power_of_2(head_dim),
        QUANT=quant, IS_INT8=quant and kc.dtype == torch.int8,
        QMAX=k_cache.qmax if quant else 1.0)
