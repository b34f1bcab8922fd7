"""8-bit KV caches: int8 or fp8 (e4m3) values with one float32 scale per token and KV head.

A quantized layer cache is a ``QuantizedKV`` in place of the dense K (or V) tensor: ``data`` has the
dense cache's shape, ``scale`` drops its last dimension. A token's K for one head is stored as
``round(k / s)`` with ``s = max|k| / QMAX`` (127 for int8, 448 for e4m3), so each 64-value head row
keeps its own range: a per-tensor scale would let one outlier token flatten every other token's keys.
At 64-wide heads that is 68 bytes a token-head against 128 in bfloat16 (1.88x the tokens in the same
memory). Reads dequantize to the compute dtype: the CUDA decode kernel folds the scales into its
scores and probabilities; the other paths (prefill, the CPU) gather and dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(slots=True)
class QuantizedKV:
    """One layer's K or V in 8 bits.

    data: [num_blocks, block_size, num_kv_heads, head_dim] int8 or float8_e4m3fn.
    scale: [num_blocks, block_size, num_kv_heads] float32, ``value = data * scale``.
    compute_dtype: what reads dequantize to (the model's dtype).
    """

    data: torch.Tensor
    scale: torch.Tensor
    compute_dtype: torch.dtype

    @classmethod
    def zeros(cls, shape: tuple[int, ...], kind: str, compute_dtype: torch.dtype,
              device: torch.device) -> QuantizedKV:
        return cls(torch.zeros(shape, dtype=QUANT_DTYPES[kind], device=device),
                   torch.zeros(shape[:-1], dtype=torch.float32, device=device), compute_dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def qmax(self) -> float:
        return _QMAX[self.data.dtype]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def raw(self) -> torch.Tensor:
        """``data`` as bytes: indexing and copies of float8 tensors are not implemented on every device."""
        return self.data.view(torch.uint8)

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        self.raw().index_fill_(0, block_ids, 0)
        self.scale.index_fill_(0, block_ids, 0)


def bytes_per_token_head(kind: str, head_dim: int) -> int:
    """Bytes one token's K (or V) takes for one KV head: the values and their float32 scale."""
    return head_dim * QUANT_DTYPES[kind].itemsize + 4


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in ``dtype``, scales [...] float32); an all-zero row gets scale 0
    and zero values."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = amax / _QMAX[dtype]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = xf * inv[..., None]
    if dtype == torch.int8:  # half away from zero (the Triton write rounds the same way)
        q = (q.sign() * (q.abs() + 0.5).floor()).clamp_(-127, 127)
    return q.to(dtype), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale[..., None]).to(dtype)


def store_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV,
                    slot_mapping: torch.Tensor) -> None:
    """``store_kv`` for 8-bit caches with torch ops (the CPU, and CUDA without Triton)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for x, cache in ((key, k_cache), (value, v_cache)):
        q, s = quantize(x, cache.dtype)
        cache.raw().view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, q.view(torch.uint8))
        cache.scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, s)


def gather_slots(cache: torch.Tensor | QuantizedKV, slots: torch.Tensor) -> torch.Tensor:
    """[len(slots), num_kv_heads, head_dim] of the cache's flat slots, dequantized if 8-bit."""
    num_kv_heads, head_dim = cache.shape[-2:]
    if not isinstance(cache, QuantizedKV):
        return cache.view(-1, num_kv_heads, head_dim)[slots]
    values = cache.raw().view(-1, num_kv_heads, head_dim)[slots].view(cache.dtype)
    return dequantize(values, cache.scale.view(-1, num_kv_heads)[slots], cache.compute_dtype)


def dense_blocks(cache: QuantizedKV, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids), block_size, num_kv_heads, head_dim] of whole blocks, dequantized."""
    return dequantize(cache.raw()[block_ids].view(cache.dtype), cache.scale[block_ids], cache.compute_dtype)


def dense_view(k_cache: QuantizedKV, v_cache: QuantizedKV, block_tables: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense K and V of just the blocks ``block_tables`` names, and the tables renumbered into them:
    for kernels that read a dense cache through block tables (the batch-invariant rows kernels). Each
    value is dequantized alone, so a row's result still does not depend on the batch."""
    ids, inverse = torch.unique(block_tables, return_inverse=True)
    return dense_blocks(k_cache, ids), dense_blocks(v_cache, ids), inverse.view_as(block_tables)
