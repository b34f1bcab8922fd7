// The fused paged decode-attention kernel's entry points (paged_decode_attention.cpp), shared with the
// fused decode-layers step (fused_decode_layers.cpp), which defines the extension module.
#pragma once

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);

bool built_with_avx512();

// x [rows <= 16, K] float32 or bfloat16 times a 4-bit weight: nibbles [N, K / 2] uint8 (q4_linear.cpp's
// layout), scales and mins [N, K / 32] float16. Returns [rows, N] in x's dtype.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins);
