// A few rows times a 4-bit weight (groups of 32, a float16 scale and minimum each: w = q * d + m), with
// the rows quantized to int8 per group of 32 (the scheme llama.cpp's Q4_1 x Q8_1 dot products use).
//
// A one-token decode step reads every weight once for one row: it is bound by how fast the weights
// stream. torch's int4 matmul widens each 4-bit value to bfloat16 before its product (about 10 GB/s on
// one Zen 4 core here); with int8 rows, 64 weights meet 64 activations in one AVX-512 VNNI instruction
// (u8 x s8 -> int32) and only each group's sum is scaled in float32. CPUs with AVX2 but no AVX-512 (most
// x86 servers before Ice Lake and Zen 4) take the same scheme 32 weights at a time (block_dots_avx2).
//
// Layout of a weight row (kernels/int4.py packs it): groups go in pairs, each pair as 32 bytes whose 64
// nibbles (the 32 low ones, then the 32 high ones) hold the pair's values interleaved 4 by 4, group 0's
// then group 1's: nibble p holds value (p / 8) * 4 + p % 4 of group (p / 4) % 2. A VNNI instruction then
// leaves group 0's partial sums in the even and group 1's in the odd int32 lanes, so one (scale, scale)
// pair broadcast over the lanes scales them. An unpaired last group is 16 bytes, byte j holding values j
// (low nibble) and j + 16 (high). The rows are quantized into the same order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define KVGATE_Q4_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVGATE_Q4_AVX2 1
#endif
#if defined(KVGATE_Q4_VNNI) || defined(KVGATE_Q4_AVX2)
#define KVGATE_Q4_SIMD 1
#endif

#include "decode.h"

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 16;
constexpr int64_t kBlock = 4;  // weight rows per pass: independent accumulator chains, one activation load

// Where nibble p of a group pair takes its value from: (group 0 or 1) * 32 + index in the group.
inline int64_t pair_source(int64_t p) { return ((p / 4) % 2) * kGroup + (p / 8) * 4 + p % 4; }

// Rows as int8 groups in the weight's order: q [rows, K]; per (row, group) the scale and scale * sum(q);
// per (row, pair) the pair's two scales repeated over 16 lanes.
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum, pair_scales;
  int64_t k, groups, pairs;
};

template <typename T>
void quantize_group(const T* src, int8_t* dst, float* scale, float* scaled_sum) {
  float amax = 0.f;
  for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(static_cast<float>(src[j])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t j = 0; j < kGroup; ++j) {
    const auto v = static_cast<int32_t>(std::lrintf(static_cast<float>(src[j]) * inv));
    dst[j] = static_cast<int8_t>(v);
    total += v;
  }
  *scale = amax / 127.f;
  *scaled_sum = *scale * static_cast<float>(total);
}

template <typename T>
QuantRows quantize(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup, pairs = groups / 2;
  QuantRows a{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups), std::vector<float>(rows * groups),
              std::vector<float>(rows * pairs * 16), k, groups, pairs};
  std::vector<int8_t> natural(k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      quantize_group(x + r * k + g * kGroup, natural.data() + g * kGroup, &a.scale[r * groups + g],
                     &a.scaled_sum[r * groups + g]);
    }
    int8_t* dst = a.q.data() + r * k;
    for (int64_t c = 0; c < pairs; ++c) {
      for (int64_t p = 0; p < 2 * kGroup; ++p) dst[c * 64 + p] = natural[c * 64 + pair_source(p)];
      for (int64_t lane = 0; lane < 16; ++lane) {
        a.pair_scales[(r * pairs + c) * 16 + lane] = a.scale[r * groups + 2 * c + lane % 2];
      }
    }
    std::copy(natural.begin() + pairs * 64, natural.end(), dst + pairs * 64);  // the unpaired group
  }
  return a;
}

// The integer dot of a weight row's group pair c with a row's (both in the paired order), per group.
inline void pair_dot_scalar(const uint8_t* w, const int8_t* a, int32_t sums[2]) {
  sums[0] = sums[1] = 0;
  for (int64_t p = 0; p < 2 * kGroup; ++p) {
    const int32_t q = p < kGroup ? (w[p] & 0x0F) : (w[p - kGroup] >> 4);
    sums[(p / 4) % 2] += q * a[p];
  }
}

// out[r] += row r . weight row (every group; mins included): plain loops.
void row_dots_scalar(const uint8_t* w, const c10::Half* d, const c10::Half* mins, const QuantRows& a, int64_t rows,
                     float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* ar = a.q.data() + r * a.k;
    const float* sc = a.scale.data() + r * a.groups;
    float t = 0.f;
    for (int64_t c = 0; c < a.pairs; ++c) {
      int32_t sums[2];
      pair_dot_scalar(w + c * kGroup, ar + c * 64, sums);
      t += sums[0] * static_cast<float>(d[2 * c]) * sc[2 * c] + sums[1] * static_cast<float>(d[2 * c + 1]) * sc[2 * c + 1];
    }
    if (a.groups % 2) {  // the unpaired last group, in its natural order
      const int64_t g = a.groups - 1;
      const uint8_t* wg = w + g * (kGroup / 2);
      int32_t s = 0;
      for (int64_t j = 0; j < kGroup / 2; ++j) {
        s += (wg[j] & 0x0F) * ar[g * kGroup + j] + (wg[j] >> 4) * ar[g * kGroup + j + 16];
      }
      t += s * static_cast<float>(d[g]) * sc[g];
    }
    for (int64_t g = 0; g < a.groups; ++g) t += static_cast<float>(mins[g]) * a.scaled_sum[r * a.groups + g];
    out[r] += t;
  }
}

#ifdef KVGATE_Q4_SIMD
// The unpaired last group of an odd number of groups, for a block's kBlock weight rows: plain loops added
// into out (the minimums are counted with the pairs').
void unpaired_group_dots(const uint8_t* w, const c10::Half* d, const QuantRows& a, int64_t rows, int64_t row_bytes,
                         float* out) {
  const int64_t groups = a.groups, g = groups - 1;
  for (int64_t i = 0; i < kBlock; ++i) {
    const uint8_t* wg = w + i * row_bytes + g * (kGroup / 2);
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* ag = a.q.data() + r * a.k + g * kGroup;
      int32_t s = 0;
      for (int64_t j = 0; j < kGroup / 2; ++j) s += (wg[j] & 0x0F) * ag[j] + (wg[j] >> 4) * ag[j + 16];
      out[i * rows + r] += s * static_cast<float>(d[i * groups + g]) * a.scale[r * groups + g];
    }
  }
}
#endif

#ifdef KVGATE_Q4_VNNI
// out[i * rows + r] = row r . weight row i of a block of kBlock rows (w, d, mins: the block's first row).
void block_dots_vnni(const uint8_t* w, const c10::Half* d, const c10::Half* mins, const QuantRows& a, int64_t rows,
                     int64_t row_bytes, float* out) {
  const int64_t groups = a.groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __mmask16 tail = static_cast<__mmask16>((1u << (groups % 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* ar = a.q.data() + r * a.k;
    const float* ps = a.pair_scales.data() + r * a.pairs * 16;
    const float* ss = a.scaled_sum.data() + r * groups;
    __m512 acc[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < a.pairs; ++c) {
      const __m512i av = _mm512_loadu_si512(ar + c * 64);
      const __m512 sa = _mm512_loadu_ps(ps + c * 16);
      for (int64_t i = 0; i < kBlock; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * row_bytes + c * 32));
        const __m256i lo = _mm256_and_si256(raw, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, av);
        int32_t two;  // the pair's two float16 scales
        std::memcpy(&two, d + i * groups + 2 * c, sizeof(two));
        const __m512 dd = _mm512_broadcast_f32x2(_mm_cvtph_ps(_mm_cvtsi32_si128(two)));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(dd, sa), acc[i]);
      }
    }
    for (int64_t i = 0; i < kBlock; ++i) {  // the minimums' share: sum over groups of min * scale * sum(q)
      const c10::Half* m = mins + i * groups;
      int64_t g = 0;
      for (; g + 16 <= groups; g += 16) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g)));
        acc[i] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(ss + g), acc[i]);
      }
      if (tail) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, m + g));
        acc[i] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(tail, ss + g), acc[i]);
      }
      out[i * rows + r] = _mm512_reduce_add_ps(acc[i]);
    }
  }
  if (groups % 2) unpaired_group_dots(w, d, a, rows, row_bytes, out);
}
#endif

#ifdef KVGATE_Q4_AVX2
// The same as block_dots_vnni with AVX2 (llama.cpp's Q4_1 x Q8_1 dot on such CPUs): maddubs multiplies the
// 32 unsigned nibbles by their signed int8 activations and adds neighbours into 16 int16 lanes (at most
// 2 * 15 * 128 each, and the low and high halves' sum fits too), madd with ones adds those pairwise into
// 8 int32 lanes of 4 values each: even lanes group 0's sums, odd lanes group 1's, as with VNNI.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void block_dots_avx2(const uint8_t* w, const c10::Half* d, const c10::Half* mins, const QuantRows& a,
                     int64_t rows, int64_t row_bytes, float* out) {
  const int64_t groups = a.groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* ar = a.q.data() + r * a.k;
    const float* ps = a.pair_scales.data() + r * a.pairs * 16;
    const float* ss = a.scaled_sum.data() + r * groups;
    __m256 acc[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < a.pairs; ++c) {
      const __m256i alo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar + c * 64));
      const __m256i ahi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar + c * 64 + 32));
      const __m256 sa = _mm256_loadu_ps(ps + c * 16);  // (scale 0, scale 1) repeated
      for (int64_t i = 0; i < kBlock; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * row_bytes + c * 32));
        const __m256i lo = _mm256_and_si256(raw, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        const __m256i pairs16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
        const __m256i dp = _mm256_madd_epi16(pairs16, ones);
        int32_t two;  // the pair's two float16 scales
        std::memcpy(&two, d + i * groups + 2 * c, sizeof(two));
        const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
        const __m128 d4 = _mm_movelh_ps(d2, d2);
        const __m256 dd = _mm256_insertf128_ps(_mm256_castps128_ps256(d4), d4, 1);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_mul_ps(dd, sa), acc[i]);
      }
    }
    for (int64_t i = 0; i < kBlock; ++i) {  // the minimums' share: sum over groups of min * scale * sum(q)
      const c10::Half* m = mins + i * groups;
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8) {
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g)));
        acc[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(ss + g), acc[i]);
      }
      float t = hsum(acc[i]);
      for (; g < groups; ++g) t += static_cast<float>(m[g]) * ss[g];
      out[i * rows + r] = t;
    }
  }
  if (groups % 2) unpaired_group_dots(w, d, a, rows, row_bytes, out);
}
#endif

#ifdef KVGATE_Q4_SIMD
constexpr int64_t kPrefetchBlocks = 4;

void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}
#endif

template <typename T>
void run(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& d, const torch::Tensor& mins,
         torch::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0), groups = k / kGroup, row_bytes = k / 2;
  const QuantRows a = quantize(x.data_ptr<T>(), rows, k);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  const c10::Half* mp = mins.data_ptr<c10::Half>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 16, [&](int64_t begin, int64_t end) {
    float dots[kBlock * kMaxRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t i0 = b * kBlock, count = std::min(kBlock, n - i0);
#ifdef KVGATE_Q4_SIMD
      if (b + kPrefetchBlocks < end) {  // the weights stream from memory once: ask for them ahead
        const int64_t ahead = (b + kPrefetchBlocks) * kBlock;
        prefetch(wp + ahead * row_bytes, kBlock * row_bytes);
        prefetch(dp + ahead * groups, kBlock * groups * sizeof(c10::Half));
        prefetch(mp + ahead * groups, kBlock * groups * sizeof(c10::Half));
      }
      if (count == kBlock) {
#ifdef KVGATE_Q4_VNNI
        block_dots_vnni(wp + i0 * row_bytes, dp + i0 * groups, mp + i0 * groups, a, rows, row_bytes, dots);
#else
        block_dots_avx2(wp + i0 * row_bytes, dp + i0 * groups, mp + i0 * groups, a, rows, row_bytes, dots);
#endif
      } else
#endif
      {
        std::fill(dots, dots + count * rows, 0.f);
        for (int64_t i = 0; i < count; ++i) {
          row_dots_scalar(wp + (i0 + i) * row_bytes, dp + (i0 + i) * groups, mp + (i0 + i) * groups, a, rows,
                          dots + i * rows);
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t r = 0; r < rows; ++r) op[r * n + i0 + i] = static_cast<T>(dots[i * rows + r]);
      }
    }
  });
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "q4_linear runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scales.dim() == 2 && mins.dim() == 2, "bad ranks");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32,
              "x must be float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kHalf &&
                  mins.scalar_type() == torch::kHalf, "weights are uint8 nibbles with float16 scales and mins");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(rows <= kMaxRows, "q4_linear takes at most ", kMaxRows, " rows, got ", rows);
  TORCH_CHECK(k % kGroup == 0 && w.size(1) * 2 == k, "x has ", k, " columns; the weight packs ", w.size(1) * 2);
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == k / kGroup && mins.sizes() == scales.sizes(),
              "one scale and one minimum per output row and group");
  x = x.contiguous();
  w = w.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  if (x.scalar_type() == torch::kFloat32) {
    run<float>(x, w, scales, mins, out);
  } else {
    run<c10::BFloat16>(x, w, scales, mins, out);
  }
  return out;
}
