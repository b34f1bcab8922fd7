// The fused paged decode-attention kernel's entry points (paged_decode_attention.cpp), shared with the
// fused decode-layers step (fused_decode_layers.cpp), which defines the extension module.
#pragma once

#include <torch/extension.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 float32 or bfloat16 values as float32 (bfloat16 is the high half of a float32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// e^x for x <= 0 (attention scores minus their running max; SiLU's e^-|x|): Cephes' expf range reduction
// and polynomial, about 2 ulp; scalef gives the 2^n factor and underflows to 0 correctly.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is 0 in float32; keeps -inf out of the maths
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

#endif

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);

bool built_with_avx512();

// x [rows <= 16, K] float32 or bfloat16 times a 4-bit weight: nibbles [N, K / 2] uint8 (q4_linear.cpp's
// layout), scales and mins [N, K / 32] float16. Returns [rows, N] in x's dtype.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins);
