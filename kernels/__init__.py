"""Attention and KV-cache kernels: torch paths plus C++ CPU kernels (batch-invariant, fused decode)."""

from kernels.cpu_ext import (
           DecodeLayerWeights,
           KernelBuildError,
           decode_kernel_loaded,
           fused_decode_layers,
           fused_dense_layers,
           load_cpu_kernels,
           load_decode_kernel,
           paged_attention_rows,
           paged_decode_attention,
)
from kernels.paged_attention import (
           AttentionMetadata,
           DecodeGroup,
           InvariantRows,
           PrefillSpan,
           decode_rows,
           paged_attention,
)
from kernels.store_kv import store_kv

__all__ = ["AttentionMetadata", "DecodeGroup", "DecodeLayerWeights", "InvariantRows", "KernelBuildError",
           "PrefillSpan", "decode_kernel_loaded", "decode_rows", "fused_decode_layers", "fused_dense_layers",
           "load_cpu_kernels", "load_decode_kernel", "paged_attention", "paged_attention_rows",
           "paged_decode_attention", "store_kv"]
