// Every decoder layer of a decode-only step in one call (the CPU's fast path for bfloat16 and float32 models).
//
// A decode step of a small model spends much of its time between its matmuls: each layer is ~35 torch
// ops (norms, RoPE, casts, residual adds, the KV write) of 1-5 us of dispatch each, and as many trips
// through Python. Here the elementwise work runs as plain loops over the step's rows, attention is the
// fused paged kernel, and the matmuls are either q4_linear's (int8 rows against the 4-bit weights, for
// steps of a few rows, which are bound by reading the weights) or ATen's bfloat16 linear (dense weights,
// for bigger steps, which are bound by arithmetic), all without returning to Python.
//
// The activations are the model's dtype T (bfloat16 or float32). Each elementwise op rounds to T where
// torch's op would (RMSNorm's statistics in float32 then the weight product, RoPE's two products and their
// sum, SiLU then the gate product, residual adds), so results match the layer-by-layer path up to the
// order of RMSNorm's float32 sum (and, in float32, fused multiply-adds).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "decode.h"

namespace {

using bf16 = c10::BFloat16;

template <typename T>
inline float f(T v) { return static_cast<float>(v); }
template <typename T>
inline T r(float v) { return static_cast<T>(v); }  // to bfloat16: round to nearest even, as torch's casts do

struct Shape {
  int64_t rows, hidden, num_heads, num_kv_heads, head_dim;
  double eps, scale;
  int64_t q_width() const { return num_heads * head_dim; }
  int64_t kv_width() const { return num_kv_heads * head_dim; }
};

// Rows [begin, end) of the step to fn, split over torch's threads in chunks of kRowGrain rows: a step of
// a few rows runs on the calling thread (a thread hand-off costs more than its loops), a 64-row step's
// SiLU and RoPE on every core.
constexpr int64_t kRowGrain = 16;

template <typename Fn>
void for_rows(int64_t rows, const Fn& fn) {
  at::parallel_for(0, rows, kRowGrain, fn);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), per row; x, out: [rows, hidden].
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, const Shape& s) {
  for_rows(s.rows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = x + i * s.hidden;
      float sum = 0.f;
      for (int64_t j = 0; j < s.hidden; ++j) sum += f(row[j]) * f(row[j]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(s.hidden) + static_cast<float>(s.eps));
      for (int64_t j = 0; j < s.hidden; ++j) out[i * s.hidden + j] = r<T>(f(weight[j]) * f(r<T>(f(row[j]) * inv)));
    }
  });
}

// Rotate-half RoPE of `heads` heads starting at src (row stride src_stride) into dst ([rows, heads, Dh]).
template <typename T>
void rope(const T* src, int64_t src_stride, int64_t heads, const T* cos, const T* sin, T* dst, const Shape& s) {
  const int64_t d = s.head_dim, half = d / 2;
  for_rows(s.rows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* c = cos + i * d;
      const T* sn = sin + i * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = src + i * src_stride + h * d;
        T* o = dst + (i * heads + h) * d;
        for (int64_t j = 0; j < d; ++j) {
          const float rotated = j < half ? -f(x[j + half]) : f(x[j - half]);
          o[j] = r<T>(f(r<T>(f(x[j]) * f(c[j]))) + f(r<T>(rotated * f(sn[j]))));
        }
      }
    }
  });
}

// Write the step's roped K and its V into their cache slots (the cache may be float32 or bfloat16).
template <typename T, typename KV>
void store(const T* k, const T* v, int64_t v_stride, const int64_t* slots, KV* kc, KV* vc,
           const Shape& s) {
  const int64_t w = s.kv_width();
  for (int64_t i = 0; i < s.rows; ++i) {
    KV* kd = kc + slots[i] * w;
    KV* vd = vc + slots[i] * w;
    for (int64_t j = 0; j < w; ++j) {
      kd[j] = static_cast<KV>(f(k[i * w + j]));
      vd[j] = static_cast<KV>(f(v[i * v_stride + j]));
    }
  }
}

// x += y, rounding each sum to T; rows of `width` elements.
template <typename T>
void add_into(T* x, const T* y, int64_t rows, int64_t width) {
  for_rows(rows, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin * width; j < end * width; ++j) x[j] = r<T>(f(x[j]) + f(y[j]));
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// float32 to bfloat16, rounding to nearest even as torch's casts do (NaN stays a quiet NaN)
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// 16 lanes of silu_mul for bfloat16: silu(g) = g * sigmoid(g), sigmoid from e^-|g| (never overflows).
inline void silu_mul16(const bf16* g, const bf16* up, bf16* out) {
  const __m512 gv = load16(g), one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
  const __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(e, pos, one), _mm512_add_ps(one, e));
  const __m512 act = _mm512_mul_ps(round_bf16(_mm512_mul_ps(gv, sig)), load16(up));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(act));
}
#endif

// act = T(silu(gate)) * up, per row of gate_up [rows, 2 * inter] (gate first).
template <typename T>
void silu_mul(const T* gate_up, T* act, int64_t rows, int64_t inter) {
  for_rows(rows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gate_up + i * 2 * inter;
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if constexpr (std::is_same<T, bf16>::value) {
        for (; j + 16 <= inter; j += 16) silu_mul16(g + j, g + inter + j, act + i * inter + j);
      }
#endif
      for (; j < inter; ++j) {
        const float gv = f(g[j]);
        act[i * inter + j] = r<T>(f(r<T>(gv / (1.f + std::exp(-gv)))) * f(g[inter + j]));
      }
    }
  });
}

// One projection's 4-bit weight (nibbles, scales, mins) times the step's rows.
struct Q4 {
  const torch::Tensor *w, *scales, *mins;
  torch::Tensor operator()(const torch::Tensor& x) const { return q4_linear(x, *w, *scales, *mins); }
};

// One projection's dense weight [out, in] (the model's dtype) times the step's rows: ATen's linear, the very
// call the layer-by-layer path makes (oneDNN's bfloat16 GEMM, or float32's BLAS, on the CPU).
struct Dense {
  const torch::Tensor* w;
  torch::Tensor operator()(const torch::Tensor& x) const { return at::linear(x, *w); }
};

void check_inputs(const torch::Tensor& x, const std::vector<torch::Tensor>& norms, size_t weights_per_layer,
                  size_t num_weights, const std::vector<torch::Tensor>& k_caches,
                  const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slots) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x must be a contiguous [rows, hidden] bfloat16 or float32 tensor");
  TORCH_CHECK(norms.size() == 2 * layers && num_weights == weights_per_layer * layers &&
                  v_caches.size() == layers,
              "two norms, four weights and one K/V cache pair per layer");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == x.size(0), "one int64 slot per row");
  for (const auto& n : norms) {
    TORCH_CHECK(n.scalar_type() == x.scalar_type() && n.is_contiguous() && n.numel() == x.size(1),
                "norm weights must be contiguous [hidden] tensors of x's dtype");
  }
  for (size_t l = 0; l < layers; ++l) {
    TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == v_caches[l].scalar_type(), "bad KV cache of layer ", l);
  }
}

template <typename T, typename KV>
void store_for(const torch::Tensor& qkv, const torch::Tensor& k_roped, const int64_t* slots,
               const torch::Tensor& kc, const torch::Tensor& vc, const Shape& s) {
  const int64_t width = qkv.size(1);
  const T* v = qkv.data_ptr<T>() + s.q_width() + s.kv_width();
  store<T, KV>(k_roped.data_ptr<T>(), v, width, slots, kc.data_ptr<KV>(), vc.data_ptr<KV>(), s);
}

// One layer, in place on x ([rows, hidden] of T). w: qkv, o, gate_up and down.
template <typename T, typename W>
void layer(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const T* in_norm,
           const T* post_norm, const W* w, const torch::Tensor& kc,
           const torch::Tensor& vc, const torch::Tensor& slots, const torch::Tensor& tables,
           const torch::Tensor& ctx, const Shape& s) {
  auto h = torch::empty_like(x);
  rms_norm(x.data_ptr<T>(), in_norm, h.data_ptr<T>(), s);
  const torch::Tensor qkv = w[0](h);  // [rows, q + 2 kv]
  TORCH_CHECK(qkv.size(1) == s.q_width() + 2 * s.kv_width(), "the qkv weight does not match the heads");
  const int64_t width = qkv.size(1);
  auto q = torch::empty({s.rows, s.num_heads, s.head_dim}, x.options());
  auto k = torch::empty({s.rows, s.num_kv_heads, s.head_dim}, x.options());
  const T* c = cos.data_ptr<T>();
  const T* sn = sin.data_ptr<T>();
  rope(qkv.data_ptr<T>(), width, s.num_heads, c, sn, q.data_ptr<T>(), s);
  rope(qkv.data_ptr<T>() + s.q_width(), width, s.num_kv_heads, c, sn, k.data_ptr<T>(), s);
  if (kc.scalar_type() == torch::kFloat32) {
    store_for<T, float>(qkv, k, slots.data_ptr<int64_t>(), kc, vc, s);
  } else {
    TORCH_CHECK(kc.scalar_type() == torch::kBFloat16, "KV cache must be float32 or bfloat16");
    store_for<T, bf16>(qkv, k, slots.data_ptr<int64_t>(), kc, vc, s);
  }
  auto attn = paged_decode_attention(q, kc, vc, tables, ctx, s.scale).view({s.rows, s.q_width()});
  const torch::Tensor o = w[1](attn);
  add_into(x.data_ptr<T>(), o.data_ptr<T>(), s.rows, s.hidden);
  rms_norm(x.data_ptr<T>(), post_norm, h.data_ptr<T>(), s);
  const torch::Tensor gate_up = w[2](h);
  const int64_t inter = gate_up.size(1) / 2;
  auto act = torch::empty({s.rows, inter}, x.options());
  silu_mul(gate_up.data_ptr<T>(), act.data_ptr<T>(), s.rows, inter);
  const torch::Tensor down = w[3](act);
  add_into(x.data_ptr<T>(), down.data_ptr<T>(), s.rows, s.hidden);
}

// What both entry points check and prepare: cos/sin, slots in range, and the step's shape.
Shape prepare(const torch::Tensor& x, torch::Tensor& cos, torch::Tensor& sin, torch::Tensor& slot_mapping,
              const std::vector<torch::Tensor>& k_caches, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps, double scale) {
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.numel() == x.size(0) * head_dim && sin.numel() == cos.numel(),
              "cos and sin must be [rows, head_dim] of x's dtype");
  cos = cos.contiguous();
  sin = sin.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const Shape s{x.size(0), x.size(1), num_heads, num_kv_heads, head_dim, eps, scale};
  const int64_t kv_slots = k_caches.empty() ? 0 : k_caches[0].numel() / s.kv_width();
  for (int64_t i = 0; i < s.rows; ++i) {
    const int64_t slot = slot_mapping.data_ptr<int64_t>()[i];
    TORCH_CHECK(slot >= 0 && slot < kv_slots, "slot ", slot, " of row ", i, " is out of range");
  }
  return s;
}

// One layer in x's dtype.
template <typename W>
void run_layer(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& in_norm,
               const torch::Tensor& post_norm, const W* w, const torch::Tensor& kc, const torch::Tensor& vc,
               const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& ctx, const Shape& s) {
  if (x.scalar_type() == torch::kFloat32) {
    layer<float>(x, cos, sin, in_norm.data_ptr<float>(), post_norm.data_ptr<float>(), w, kc, vc, slots, tables,
                 ctx, s);
  } else {
    layer<bf16>(x, cos, sin, in_norm.data_ptr<bf16>(), post_norm.data_ptr<bf16>(), w, kc, vc, slots, tables,
                ctx, s);
  }
}

}  // namespace

torch::Tensor fused_decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                  std::vector<torch::Tensor> norms, std::vector<torch::Tensor> nibbles,
                                  std::vector<torch::Tensor> scales, std::vector<torch::Tensor> mins,
                                  std::vector<torch::Tensor> k_caches,
                                  std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping,
                                  torch::Tensor block_tables, torch::Tensor context_lens, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  check_inputs(x, norms, 4, nibbles.size(), k_caches, v_caches, slot_mapping);
  TORCH_CHECK(scales.size() == nibbles.size() && mins.size() == nibbles.size(),
              "nibbles, scales and mins for every weight");
  const Shape s = prepare(x, cos, sin, slot_mapping, k_caches, num_heads, num_kv_heads, head_dim, eps, scale);
  x = x.clone();
  for (size_t l = 0; l < k_caches.size(); ++l) {
    Q4 w[4];
    for (size_t i = 0; i < 4; ++i) w[i] = Q4{&nibbles[4 * l + i], &scales[4 * l + i], &mins[4 * l + i]};
    run_layer(x, cos, sin, norms[2 * l], norms[2 * l + 1], w, k_caches[l], v_caches[l], slot_mapping,
              block_tables, context_lens, s);
  }
  return x;
}

torch::Tensor fused_dense_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                 std::vector<torch::Tensor> norms, std::vector<torch::Tensor> weights,
                                 std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                                 torch::Tensor slot_mapping, torch::Tensor block_tables,
                                 torch::Tensor context_lens, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, double eps, double scale) {
  check_inputs(x, norms, 4, weights.size(), k_caches, v_caches, slot_mapping);
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == x.scalar_type() && w.device().is_cpu(),
                "dense weights must be [out, in] CPU tensors of x's dtype");
  }
  const Shape s = prepare(x, cos, sin, slot_mapping, k_caches, num_heads, num_kv_heads, head_dim, eps, scale);
  x = x.clone();
  for (size_t l = 0; l < k_caches.size(); ++l) {
    Dense w[4];
    for (size_t i = 0; i < 4; ++i) w[i] = Dense{&weights[4 * l + i]};
    run_layer(x, cos, sin, norms[2 * l], norms[2 * l + 1], w, k_caches[l], v_caches[l], slot_mapping,
              block_tables, context_lens, s);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: an engine thread in the gateway's process must not stall its event loop.
  m.def("paged_decode_attention", &paged_decode_attention, "Fused paged decode attention (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_decode_layers", &fused_decode_layers, "Every decoder layer of a few-row int4 decode step",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_dense_layers", &fused_dense_layers,
        "Every decoder layer of a decode step on dense weights", py::call_guard<py::gil_scoped_release>());
  m.def("q4_linear", &q4_linear, "A few rows times a 4-bit weight, the rows quantized to int8 per group",
        py::call_guard<py::gil_scoped_release>());
  m.def("built_with_avx512", &built_with_avx512, "Whether the AVX-512 path was compiled in");
}
