// The fused paged decode-attention kernel's entry points (paged_decode_attention.cpp), shared with the
// fused decode-layers step (fused_decode_layers.cpp), which defines the extension module.
#pragma once

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);

bool built_with_avx512();
