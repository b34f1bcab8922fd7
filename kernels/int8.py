"""8-bit weights in groups of 32 with a float32 scale each (GGUF's Q8_0 layout), for few-row matmuls.

Used for the LM head, the largest matrix of a small model and a one-token step's biggest read: a Q8_0
checkpoint's head comes back exactly, in half of bfloat16's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_ext import int8_group_linear
from kernels.int4 import EXACT_TOL, GROUP_SIZE, groups_of


@dataclass(slots=True)
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / GROUP_SIZE] float32
    max_error: float  # largest |requantized - original| over its group's step


def pack_int8(weight: torch.Tensor) -> Int8Weight:
    """Quantize ``weight`` [N, K] symmetrically per group of 32 along K: scale = max |w| / 127.

    Raises:
        ValueError: K is not a multiple of the group size.
    """
    n, k = weight.shape
    w = groups_of(weight, "int8")
    scale = (w.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale).round_().clamp_(-127, 127)
    max_error = float(((q * scale - w).abs() / scale).amax())
    return Int8Weight(q.to(torch.int8).reshape(n, k), scale.reshape(n, -1).contiguous(), max_error)


def is_exact(w8: Int8Weight) -> bool:
    """Every group came back on its own 8-bit grid (the weight was Q8_0 before it was dequantized)."""
    return w8.max_error <= EXACT_TOL


def int8_linear(x: torch.Tensor, w8: Int8Weight) -> torch.Tensor:
    """``x @ W.T``. x: [M, K] float32 or bfloat16 → [M, N] float32."""
    return int8_group_linear(x, w8.q, w8.scales, GROUP_SIZE)
