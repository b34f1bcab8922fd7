"""The Llama family's layers: RMSNorm, rotary embeddings, and the decoder layer (attention over the paged
KV cache, then the gated MLP), each projection on the dense weights, a batch-invariant plan's kernels or
the layer's 4-bit copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.determinism import TilePlan, TritonPlan, tiled_linear
from engine.runner.loader import ModelConfig
from kernels import AttentionMetadata, paged_attention, store_kv
from kernels.cpu_ext import q4_linear
from kernels.int4 import Int4Weight, int4_linear

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as transformers computes it (float32 statistics, cast back before the weight)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, H, Dh]; cos, sin: [T, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def linear(x: torch.Tensor, layer: nn.Linear, plan: TilePlan | TritonPlan | None) -> torch.Tensor:
    return tiled_linear(x, layer.weight, layer.bias, plan)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
          plan: TilePlan | TritonPlan | None) -> torch.Tensor:
    """RMSNorm; a batch-invariant plan may bring its own per-row kernel."""
    if plan is not None and plan.rms_norm is not None:
        return plan.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q, kv, kv)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.int4: dict[str, Int4Weight] | None = None  # 4-bit copies for few-row steps (pack_int4)

    def _proj(self, name: str, x: torch.Tensor, plan: TilePlan | TritonPlan | None,
              use_int4: bool) -> torch.Tensor:
        if use_int4:
            w4 = self.int4[name]
            if x.dtype == torch.bfloat16:
                return int4_linear(x, w4)
            out = q4_linear(x, w4.nibbles, w4.scales, w4.mins)  # float32 rows (torch's int4 matmul is bf16)
            return out if w4.bias is None else out + w4.bias
        return linear(x, getattr(self, name), plan)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], use_int4: bool = False) -> torch.Tensor:
        # x: [T, hidden]
        t, rows = x.shape[0], meta.linear_plan  # rows: the batch-invariant plan, or None
        qkv = self._proj("qkv", norm(x, self.input_norm, self.eps, rows), rows, use_int4)
        # RoPE on the query and key heads in one pass (elementwise, so bitwise what two passes give): a
        # one-token step is dispatch-bound, and this halves RoPE's ops
        qk = apply_rope(qkv[:, :self.split[0] + self.split[1]].view(t, -1, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.split[0] + self.split[1]:]
        store_kv(k, v.view(t, self.num_kv_heads, self.head_dim), kv_cache[0], kv_cache[1], meta.slot_mapping)
        attn = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        x = x + self._proj("o", attn, rows, use_int4)
        gate_up = self._proj("gate_up", norm(x, self.post_norm, self.eps, rows), rows, use_int4)
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self._proj("down", F.silu(gate) * up, rows, use_int4)
