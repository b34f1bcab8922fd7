// A linear layer over int8 weights with one float32 scale per group of G consecutive inputs (GGUF's
// Q8_0 layout), for the few rows of a decode step: out[m, n] = sum_g scale[n, g] * sum_k q[n, gG + k] *
// x[m, gG + k]. Such a step is bound by reading the weight, and int8 moves half of bfloat16's bytes.
// Output rows are split over torch's intra-op threads; each weight row is read once from memory and
// reused from L1 for every input row. The sums are float32 and promise no bitwise result.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

float group_dot(const int8_t* q, const float* x, int64_t group) {
  float part = 0.f;
  for (int64_t k = 0; k < group; ++k) part += static_cast<float>(q[k]) * x[k];
  return part;
}

// One output: sum over groups of scale * (q . x) for one weight row and one input row.
float row_dot(const int8_t* q, const float* s, const float* x, int64_t groups, int64_t group) {
#if defined(__AVX512F__)
  if (group % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 part = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
        part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), _mm512_loadu_ps(x + k), part);
      }
      acc = _mm512_fmadd_ps(_mm512_set1_ps(s[g]), part, acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (group % 8 == 0) {  // CPUs without AVX-512: 8 lanes
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 part = _mm256_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), _mm256_loadu_ps(x + k), part);
      }
      acc = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), part, acc);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
#endif
  float acc = 0.f;
  for (int64_t g = 0; g < groups; ++g) acc += s[g] * group_dot(q + g * group, x + g * group, group);
  return acc;
}

}  // namespace

// x [M, K] float32 or bfloat16; q [N, K] int8; scales [N, K / group] float32. Returns [M, N] float32.
torch::Tensor int8_group_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scales.device().is_cpu(),
              "int8_group_linear runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2, "x, q and scales must be 2-D");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && scales.scalar_type() == torch::kFloat32,
              "q must be int8 and scales float32");
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = q.size(0);
  TORCH_CHECK(group > 0 && k_dim % group == 0 && q.size(1) == k_dim, "K must be a multiple of the group");
  const int64_t groups = k_dim / group;
  TORCH_CHECK(scales.size(0) == n_dim && scales.size(1) == groups, "one scale per row and group");
  auto xf = x.to(torch::kFloat32).contiguous();
  q = q.contiguous();
  scales = scales.contiguous();
  auto out = torch::empty({rows, n_dim}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n_dim, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qr = qp + n * k_dim;
      const float* sr = sp + n * groups;
      for (int64_t m = 0; m < rows; ++m) op[m * n_dim + n] = row_dot(qr, sr, xp + m * k_dim, groups, group);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: an engine thread in the gateway's process must not stall its event loop.
  m.def("int8_group_linear", &int8_group_linear, "Grouped int8 linear for few rows (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
