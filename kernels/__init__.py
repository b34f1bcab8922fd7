"""Attention and KV-cache kernels: torch implementations plus a batch-invariant C++ CPU kernel."""

from kernels.cpu_ext import KernelBuildError, load_cpu_kernels, paged_attention_rows
from kernels.paged_attention import (
           AttentionMetadata,
           DecodeGroup,
           InvariantRows,
           PrefillSpan,
           paged_attention,
)
from kernels.store_kv import store_kv

__all__ = ["AttentionMetadata", "DecodeGroup", "InvariantRows", "KernelBuildError", "PrefillSpan",
           "load_cpu_kernels", "paged_attention", "paged_attention_rows", "store_kv"]
