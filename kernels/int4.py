"""4-bit weights (groups of 32, a scale and an offset each) for the CPU's few-row matmuls.

A decode step of one or a few sequences reads every weight once for a handful of rows: it is bound by
memory bandwidth, and a 4-bit copy moves a quarter of bfloat16's bytes. torch's CPU int4 matmul takes
bfloat16 activations, scales and offsets; past a few rows it is slower than a bfloat16 GEMM, so the dense
weights stay for larger steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32
# A group is exactly n-bit when requantizing it moves no weight by more than this share of its step:
# weights that a 4- or 8-bit checkpoint (a Q4_0/Q4_1/Q8_0 GGUF) was dequantized into come back exactly.
EXACT_TOL = 1e-3


@dataclass(slots=True)
class Int4Weight:
    """One linear's weight as packed 4-bit values and per-group bfloat16 (scale, offset) pairs."""

    packed: torch.Tensor  # torch's CPU int4 layout of [N, K] 4-bit values
    scales_zeros: torch.Tensor  # [K / GROUP_SIZE, N, 2] bfloat16: w = (q - 8) * scale + zero
    bias: torch.Tensor | None
    max_error: float  # largest |requantized - original| over the group's step, any group
    # The same values for kernels.q4_linear: [N, K / 2] uint8 nibbles in its order (_q4_nibbles);
    # w = q * scale + min with float16 [N, K / GROUP_SIZE] scales and mins (a Q4_1 GGUF's own).
    nibbles: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor


def int4_available(device: torch.device) -> bool:
    """torch's CPU int4 matmul exists in this build (it does from torch 2.6 on)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def groups_of(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` [N, K] as float32 groups [N, K / 32, 32] along K.

    Raises:
        ValueError: K is not a multiple of the group size.
    """
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"{kind} weights need K a multiple of {GROUP_SIZE}, got {k}")
    return weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)


def pack_int4(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Weight:
    """Quantize ``weight`` [N, K] (K a multiple of 32) per group of 32 along K to 16 levels between the
    group's minimum and maximum.

    Raises:
        ValueError: K is not a multiple of the group size.
    """
    n, k = weight.shape
    w = groups_of(weight, "int4")
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((w - lo) / step).round_().clamp_(0, 15)
    max_error = float((((q * step + lo) - w).abs() / step).amax())
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), 1)
    zeros = lo + 8 * step  # torch's convention: w = (q - 8) * scale + zero
    scales_zeros = torch.cat([step, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    nibbles = _q4_nibbles(q.to(torch.uint8).reshape(n, k))
    return Int4Weight(packed, scales_zeros, None if bias is None else bias.detach().to(torch.bfloat16),
                      max_error, nibbles, step[..., 0].half(), lo[..., 0].half())


def is_exact(w4: Int4Weight) -> bool:
    """Every group came back on its own 4-bit grid (the weight was 4-bit before it was dequantized)."""
    return w4.max_error <= EXACT_TOL


def int4_linear(x: torch.Tensor, w4: Int4Weight) -> torch.Tensor:
    """``x @ W.T + b`` with the 4-bit weight. x: [M, K] bfloat16 → [M, N] bfloat16."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), w4.packed, GROUP_SIZE, w4.scales_zeros)
    return out if w4.bias is None else out + w4.bias


def _pair_order() -> torch.Tensor:
    """Nibble p of a group pair holds value (p // 8) * 4 + p % 4 of group (p // 4) % 2: an int32 lane of
    a VNNI product then sums 4 values of one group, even lanes group 0's and odd lanes group 1's."""
    p = torch.arange(2 * GROUP_SIZE)
    return ((p // 4) % 2) * GROUP_SIZE + (p // 8) * 4 + p % 4


def _q4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 values 0..15 → [N, K / 2] bytes in csrc/q4_linear.cpp's layout: each pair of groups
    as 32 bytes, their low nibbles the pair's first 32 values in ``_pair_order`` and their high nibbles
    the next 32; an unpaired last group as 16 bytes holding values j (low) and j + 16 (high)."""
    n, k = q.shape
    pairs = k // (2 * GROUP_SIZE)
    v = q[:, :pairs * 2 * GROUP_SIZE].reshape(n, pairs, 2 * GROUP_SIZE)[:, :, _pair_order()]
    paired = (v[..., :GROUP_SIZE] | (v[..., GROUP_SIZE:] << 4)).reshape(n, -1)
    last = q[:, pairs * 2 * GROUP_SIZE:].reshape(n, -1, GROUP_SIZE)
    unpaired = (last[..., :GROUP_SIZE // 2] | (last[..., GROUP_SIZE // 2:] << 4)).reshape(n, -1)
    return torch.cat([paired, unpaired], 1)


def unpack_q4(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_q4_nibbles``: [N, K / 2] bytes → [N, K] values 0..15 (uint8)."""
    n, half = nibbles.shape
    pairs = half // GROUP_SIZE
    paired = nibbles[:, :pairs * GROUP_SIZE].reshape(n, pairs, GROUP_SIZE)
    v = torch.cat([paired & 0x0F, paired >> 4], -1)
    q = torch.empty_like(v)
    q[:, :, _pair_order()] = v
    last = nibbles[:, pairs * GROUP_SIZE:].reshape(n, -1, GROUP_SIZE // 2)
    return torch.cat([q.reshape(n, -1), torch.cat([last & 0x0F, last >> 4], -1).reshape(n, -1)], 1)
