"""Attention and KV-cache kernels: torch implementations (CPU) behind the interface Triton kernels fill."""

from kernels.paged_attention import AttentionMetadata, DecodeGroup, PrefillSpan, paged_attention
from kernels.store_kv import store_kv

__all__ = ["AttentionMetadata", "DecodeGroup", "PrefillSpan", "paged_attention", "store_kv"]
