// Fused paged decode attention for the CPU (the fast, non-batch-invariant path). One query token per row
// attends to keys [0, context_len) of its sequence, read in place through the block table (no gather):
// an online softmax makes one pass over the keys, the G query heads of a KV head share every K/V load,
// and everything accumulates in float32 whether K/V are float32 or bfloat16. Work items are whole rows,
// split over torch's intra-op threads, once there are at least two rows a thread (a row's keys then stream
// from memory once for all its KV heads: a 16-key tile of a 16-slot block is one contiguous run), and
// (row, KV head) pairs below that, so that a lone row still uses every core.
//
// Unlike paged_attention_rows.cpp this kernel promises no bitwise result: its last bits may change with
// the instruction set it was built for. Entries of a block table past a row's context are never read.
// The extension's module is defined in fused_decode_layers.cpp, built with this file.
#include <torch/extension.h>
#include "decode.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVGATE_ATTN_AVX2 1
#endif

namespace {

constexpr int64_t kTile = 16;  // keys per online-softmax step: one AVX-512 vector (two AVX2 ones) of scores
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kSlack = 8.f;  // how far scores may exceed the running maximum before it is raised

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

// Per-thread scratch for one work item, for every query head of a row: the query (float32, in the order
// the vector path reads K/V in; raw bfloat16 for the bfloat16 dot-product path), the running max / sum (l,
// or lane-wise lv in the vector paths) / output, and one tile of scores per query head of a group
// (probabilities after the softmax step).
struct Scratch {
  std::vector<float> q, acc, m, l, lv, s;
  std::vector<uint16_t> qb;
  explicit Scratch(const Geometry& g)
      : q(g.num_heads * g.head_dim), acc(g.num_heads * g.head_dim), m(g.num_heads), l(g.num_heads),
        lv(g.num_heads * kTile), s(g.group * kTile), qb(g.num_heads * g.head_dim) {}
};

// The part of the scratch one KV head's G query heads use.
struct Heads {
  float *q, *acc, *m, *l, *lv, *s;
  const uint16_t* qb;
  Heads(Scratch& w, int64_t kv_head, const Geometry& g)
      : q(w.q.data() + kv_head * g.group * g.head_dim), acc(w.acc.data() + kv_head * g.group * g.head_dim),
        m(w.m.data() + kv_head * g.group), l(w.l.data() + kv_head * g.group),
        lv(w.lv.data() + kv_head * g.group * kTile), s(w.s.data()),
        qb(w.qb.data() + kv_head * g.group * g.head_dim) {}
};

// The K and V rows (at KV head 0; head h is h * head_dim further) for keys [j0, j0 + n), walking the block
// table (one division per tile); slots past n repeat key j0, so a vector loop may run the whole tile and
// mask the scores. Slots are int64 all the way: a pool of more than 2^31 elements is reachable.
template <typename T>
inline void tile_rows(const T* k, const T* v, const int64_t* table, int64_t j0, int64_t n, const Geometry& g,
                      const T** k_rows, const T** v_rows) {
  const int64_t token_stride = g.num_kv_heads * g.head_dim;
  int64_t b = j0 / g.block_size, off = j0 % g.block_size;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = (table[b] * g.block_size + off) * token_stride;
    k_rows[t] = k + pos;
    v_rows[t] = v + pos;
    if (++off == g.block_size) {
      off = 0;
      ++b;
    }
  }
  for (int64_t t = n; t < kTile; ++t) {
    k_rows[t] = k_rows[0];
    v_rows[t] = v_rows[0];
  }
}

// Read the tile's K and V rows (every KV head) once, in address order, before the per-head passes: each
// block is one contiguous run, which the hardware's stream prefetcher then fetches ahead of the loads,
// where the per-head passes' strided reads leave each line to a demand miss of its own.
template <typename T>
inline void touch_tile(const T* const* k_rows, const T* const* v_rows, int64_t n, const Geometry& g) {
  constexpr int64_t kLine = 64;
  const int64_t bytes = g.num_kv_heads * g.head_dim * static_cast<int64_t>(sizeof(T));
  int32_t sink = 0;
  for (int64_t t = 0; t < n; ++t) {
    const char* kp = reinterpret_cast<const char*>(k_rows[t]);
    for (int64_t b = 0; b < bytes; b += kLine) sink |= *reinterpret_cast<const volatile int32_t*>(kp + b);
  }
  for (int64_t t = 0; t < n; ++t) {
    const char* vp = reinterpret_cast<const char*>(v_rows[t]);
    for (int64_t b = 0; b < bytes; b += kLine) sink |= *reinterpret_cast<const volatile int32_t*>(vp + b);
  }
  asm volatile("" : : "r"(sink));
}

template <typename KV>
constexpr bool kPermuted = std::is_same<KV, c10::BFloat16>::value;

// Where dim x of a head sits in the AVX-512 path's order for a cache of KV: bfloat16 rows widen 32 dims
// at a time into (even dims, odd dims) (load32); a 16-dim tail keeps its order. Plain C++, as every build
// lays out its queries through it.
template <typename KV>
inline int64_t slot_of(int64_t x, int64_t d) {
  const int64_t c = x / 32 * 32, i = x % 32;
  if (!kPermuted<KV> || c + 32 > d) return x;
  return c + (i % 2) * 16 + i / 2;
}

// ---- portable path: plain loops the compiler may vectorise for whatever CPU it targets ----

template <typename T>
void tile_scalar(const T* const* k_rows, const T* const* v_rows, int64_t off, int64_t n, const Geometry& g,
                 float scale, const Heads& w) {
  const int64_t d = g.head_dim;
  for (int64_t qi = 0; qi < g.group; ++qi) {
    const float* q = w.q + qi * d;
    float* s = w.s + qi * kTile;
    float tile_max = kNegInf;
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.f;
      for (int64_t x = 0; x < d; ++x) dot += q[x] * static_cast<float>(k_rows[t][off + x]);
      s[t] = dot * scale;
      tile_max = std::max(tile_max, s[t]);
    }
    float* acc = w.acc + qi * d;
    if (tile_max > w.m[qi]) {  // rescale what the earlier keys contributed to the new maximum
      const float alpha = std::exp(w.m[qi] - tile_max);
      w.l[qi] *= alpha;
      for (int64_t x = 0; x < d; ++x) acc[x] *= alpha;
      w.m[qi] = tile_max;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float p = std::exp(s[t] - w.m[qi]);
      w.l[qi] += p;
      for (int64_t x = 0; x < d; ++x) acc[x] += p * static_cast<float>(v_rows[t][off + x]);
    }
  }
}

// ---- AVX-512 path (head_dim a multiple of 16) ----
#if defined(__AVX512F__)

// The 16 horizontal sums of d[0..16) as one vector (lane t = sum of d[t]): a transposing add tree, about
// 45 instructions where 16 separate reductions take about 130.
inline __m512 hsum16(const __m512* d) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: d[2i]'s 8 partials, lanes 8-15: d[2i+1]'s
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarter q: 4 partials of d[4i + q]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // quarter q: 2 partials of d[8i + q], then 2 of d[8i + 4 + q]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  }
  // lane 4q + j: the sum of d[4j + q]; the permutation puts the sum of d[t] in lane t
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// 32 dims of a K or V row as two float32 vectors. bfloat16 ones come out as (even dims, odd dims): a shift
// and a mask, where the natural order costs two widening shuffles. The float32 queries are stored in the
// same order (slot_of), so dot products are unchanged, and the outputs are put back in order at the end.
inline void load32(const float* p, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(p);
  b = _mm512_loadu_ps(p + 16);
}

inline void load32(const c10::BFloat16* p, __m512& a, __m512& b) {
  const __m512i raw = _mm512_loadu_si512(p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// dots[t] = the 16 partial sums of query . key t, for all kTile keys (float32 queries in slot_of order).
template <typename KV>
inline void dots_f32(const float* q, const KV* const* k_rows, int64_t off, int64_t d, __m512* dots) {
  for (int64_t t = 0; t < kTile; t += 4) {  // eight FMA chains: four keys, two halves of each 32 dims
    __m512 a[4], b[4];
    for (int u = 0; u < 4; ++u) a[u] = b[u] = _mm512_setzero_ps();
    int64_t x = 0;
    for (; x + 32 <= d; x += 32) {
      const __m512 qa = _mm512_loadu_ps(q + x), qb = _mm512_loadu_ps(q + x + 16);
      for (int u = 0; u < 4; ++u) {
        __m512 ka, kb;
        load32(k_rows[t + u] + off + x, ka, kb);
        a[u] = _mm512_fmadd_ps(qa, ka, a[u]);
        b[u] = _mm512_fmadd_ps(qb, kb, b[u]);
      }
    }
    if (x < d) {  // a 16-dim tail
      const __m512 qa = _mm512_loadu_ps(q + x);
      for (int u = 0; u < 4; ++u) a[u] = _mm512_fmadd_ps(qa, load16(k_rows[t + u] + off + x), a[u]);
    }
    for (int u = 0; u < 4; ++u) dots[t + u] = _mm512_add_ps(a[u], b[u]);
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 queries and keys: one dot-product instruction per 32 dims (products of bfloat16
// pairs are exact in float32), eight keys at a time.
inline void dots_bf16(const uint16_t* q, const c10::BFloat16* const* k_rows, int64_t off, int64_t d,
                      __m512* dots) {
  for (int64_t t = 0; t < kTile; t += 8) {
    __m512 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
    int64_t x = 0;
    for (; x + 32 <= d; x += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + x);
      for (int u = 0; u < 8; ++u) {
        a[u] = _mm512_dpbf16_ps(a[u], qv, (__m512bh)_mm512_loadu_si512(k_rows[t + u] + off + x));
      }
    }
    if (x < d) {  // a 16-dim tail, zero-extended
      const __m512bh qv = (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(q + x)));
      for (int u = 0; u < 8; ++u) {
        const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k_rows[t + u] + off + x));
        a[u] = _mm512_dpbf16_ps(a[u], qv, (__m512bh)_mm512_zextsi256_si512(k));
      }
    }
    for (int u = 0; u < 8; ++u) dots[t + u] = a[u];
  }
}
#endif

// acc[h] += sum over the tile's keys t of s[h][t] * V[t], for NH query heads of a group (V in slot_of
// order): every V load and widening serves all NH heads.
template <int NH, typename KV>
inline void pv_heads(const KV* const* v_rows, int64_t off, int64_t d, const float* s, float* acc) {
  int64_t x = 0;
  for (; x + 32 <= d; x += 32) {
    __m512 a[NH][2];
    for (int h = 0; h < NH; ++h) {
      a[h][0] = _mm512_loadu_ps(acc + h * d + x);
      a[h][1] = _mm512_loadu_ps(acc + h * d + x + 16);
    }
    for (int64_t t = 0; t < kTile; ++t) {
      __m512 va, vb;
      load32(v_rows[t] + off + x, va, vb);
      for (int h = 0; h < NH; ++h) {
        const __m512 p = _mm512_set1_ps(s[h * kTile + t]);
        a[h][0] = _mm512_fmadd_ps(p, va, a[h][0]);
        a[h][1] = _mm512_fmadd_ps(p, vb, a[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      _mm512_storeu_ps(acc + h * d + x, a[h][0]);
      _mm512_storeu_ps(acc + h * d + x + 16, a[h][1]);
    }
  }
  if (x < d) {
    __m512 a[NH];
    for (int h = 0; h < NH; ++h) a[h] = _mm512_loadu_ps(acc + h * d + x);
    for (int64_t t = 0; t < kTile; ++t) {
      const __m512 v = load16(v_rows[t] + off + x);
      for (int h = 0; h < NH; ++h) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(s[h * kTile + t]), v, a[h]);
    }
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(acc + h * d + x, a[h]);
  }
}

// One tile of keys for one KV head's G query heads: scores, the online softmax step, then P.V. Slots past
// n hold a real key (tile_rows) whose probability is 0. ``Q`` picks the bfloat16 dot-product path.
template <typename KV, typename Q>
void tile_avx512(const KV* const* k_rows, const KV* const* v_rows, int64_t off, int64_t n, const Geometry& g,
                 float scale, const Heads& w) {
  const int64_t d = g.head_dim;
  const __mmask16 valid = static_cast<__mmask16>(n == kTile ? 0xFFFF : (1u << n) - 1);
  for (int64_t qi = 0; qi < g.group; ++qi) {
    __m512 dots[kTile];
#if defined(__AVX512BF16__)
    if constexpr (std::is_same<KV, c10::BFloat16>::value && std::is_same<Q, c10::BFloat16>::value) {
      dots_bf16(w.qb + qi * d, k_rows, off, d, dots);
    } else {
      dots_f32(w.q + qi * d, k_rows, off, d, dots);
    }
#else
    dots_f32(w.q + qi * d, k_rows, off, d, dots);
#endif
    const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid,
                                         _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale)));
    float* acc = w.acc + qi * d;
    float* lv = w.lv + qi * kTile;
    // m need not be the exact running maximum, only within kSlack of it: e^(s - m) <= e^kSlack cannot
    // overflow, and the final division cancels whatever m was. So most tiles skip the maximum's reduction
    // and the rescale.
    if (_mm512_cmp_ps_mask(sv, _mm512_set1_ps(w.m[qi] + kSlack), _CMP_GT_OQ)) {
      const float tile_max = _mm512_reduce_max_ps(sv);
      const __m512 a = _mm512_set1_ps(std::exp(w.m[qi] - tile_max));
      _mm512_storeu_ps(lv, _mm512_mul_ps(a, _mm512_loadu_ps(lv)));
      for (int64_t x = 0; x < d; x += 16) _mm512_storeu_ps(acc + x, _mm512_mul_ps(a, _mm512_loadu_ps(acc + x)));
      w.m[qi] = tile_max;
    }
    const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(w.m[qi]))));
    _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), p));  // lane-wise sums, added up at the end
    _mm512_storeu_ps(w.s + qi * kTile, p);
  }
  for (int64_t h0 = 0; h0 < g.group; h0 += 4) {  // P.V, four query heads at a time
    const float* s = w.s + h0 * kTile;
    float* acc = w.acc + h0 * d;
    switch (std::min<int64_t>(4, g.group - h0)) {
      case 1: pv_heads<1>(v_rows, off, d, s, acc); break;
      case 2: pv_heads<2>(v_rows, off, d, s, acc); break;
      case 3: pv_heads<3>(v_rows, off, d, s, acc); break;
      default: pv_heads<4>(v_rows, off, d, s, acc); break;
    }
  }
}

#endif  // __AVX512F__

// ---- AVX2 path (head_dim a multiple of 8): CPUs without AVX-512; the same steps 8 lanes at a time ----
#if defined(KVGATE_ATTN_AVX2)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {  // bfloat16 is the high half of a float32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// e^x for x <= 0, as exp16: Cephes' range reduction and polynomial; x is clamped at -87 so that 2^n stays
// a normal float built in the exponent bits (e^-87 ~ 1.6e-38, which the sums do not see).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The 8 horizontal sums of d[0..8) as one vector (lane t = sum of d[t]).
inline __m256 hsum8(const __m256* d) {
  const __m256 s01 = _mm256_hadd_ps(d[0], d[1]), s23 = _mm256_hadd_ps(d[2], d[3]);
  const __m256 s45 = _mm256_hadd_ps(d[4], d[5]), s67 = _mm256_hadd_ps(d[6], d[7]);
  const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

template <typename T>
void tile_avx2(const T* const* k_rows, const T* const* v_rows, int64_t off, int64_t n, const Geometry& g,
               float scale, const Heads& w) {
  const int64_t d = g.head_dim;
  const __m256 count = _mm256_set1_ps(static_cast<float>(n));
  const __m256 valid[2] = {_mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), count, _CMP_LT_OQ),
                           _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), count, _CMP_LT_OQ)};
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  for (int64_t qi = 0; qi < g.group; ++qi) {
    const float* q = w.q + qi * d;
    float* s = w.s + qi * kTile;
    __m256 dots[kTile];
    for (int64_t t = 0; t < kTile; ++t) dots[t] = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {  // four keys at a time: four FMA chains share each query load
      __m256 d0 = dots[t], d1 = dots[t + 1], d2 = dots[t + 2], d3 = dots[t + 3];
      for (int64_t x = 0; x < d; x += 8) {
        const __m256 qv = _mm256_loadu_ps(q + x);
        d0 = _mm256_fmadd_ps(qv, load8(k_rows[t] + off + x), d0);
        d1 = _mm256_fmadd_ps(qv, load8(k_rows[t + 1] + off + x), d1);
        d2 = _mm256_fmadd_ps(qv, load8(k_rows[t + 2] + off + x), d2);
        d3 = _mm256_fmadd_ps(qv, load8(k_rows[t + 3] + off + x), d3);
      }
      dots[t] = d0, dots[t + 1] = d1, dots[t + 2] = d2, dots[t + 3] = d3;
    }
    for (; t < n; ++t) {
      for (int64_t x = 0; x < d; x += 8) {
        dots[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + x), load8(k_rows[t] + off + x), dots[t]);
      }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 sv[2];
    for (int h = 0; h < 2; ++h) sv[h] = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(hsum8(dots + 8 * h), sc), valid[h]);
    float* acc = w.acc + qi * d;
    float* lv = w.lv + qi * kTile;
    // the running maximum need only be within kSlack of the true one (see tile_avx512)
    const __m256 limit = _mm256_set1_ps(w.m[qi] + kSlack);
    if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(sv[0], limit, _CMP_GT_OQ),
                                        _mm256_cmp_ps(sv[1], limit, _CMP_GT_OQ)))) {
      const float tile_max = hmax8(_mm256_max_ps(sv[0], sv[1]));
      const __m256 a = _mm256_set1_ps(std::exp(w.m[qi] - tile_max));
      for (int64_t x = 0; x < kTile; x += 8) _mm256_storeu_ps(lv + x, _mm256_mul_ps(a, _mm256_loadu_ps(lv + x)));
      for (int64_t x = 0; x < d; x += 8) _mm256_storeu_ps(acc + x, _mm256_mul_ps(a, _mm256_loadu_ps(acc + x)));
      w.m[qi] = tile_max;
    }
    const __m256 m = _mm256_set1_ps(w.m[qi]);
    for (int h = 0; h < 2; ++h) {
      const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(sv[h], m)), valid[h]);
      _mm256_storeu_ps(lv + 8 * h, _mm256_add_ps(_mm256_loadu_ps(lv + 8 * h), p));
      _mm256_storeu_ps(s + 8 * h, p);
    }
    for (int64_t x = 0; x < d; x += 8) {  // four chains: the FMA latency no output vector waits on
      __m256 a0 = _mm256_loadu_ps(acc + x), a1 = _mm256_setzero_ps(), a2 = a1, a3 = a1;
      t = 0;
      for (; t + 4 <= n; t += 4) {
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(s[t]), load8(v_rows[t] + off + x), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(s[t + 1]), load8(v_rows[t + 1] + off + x), a1);
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(s[t + 2]), load8(v_rows[t + 2] + off + x), a2);
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(s[t + 3]), load8(v_rows[t + 3] + off + x), a3);
      }
      for (; t < n; ++t) a0 = _mm256_fmadd_ps(_mm256_set1_ps(s[t]), load8(v_rows[t] + off + x), a0);
      _mm256_storeu_ps(acc + x, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
  }
}

#endif  // KVGATE_ATTN_AVX2

// Whether the AVX-512 path runs this head size (its query and output orders are slot_of's).
inline bool avx512_path(int64_t d) {
#if defined(__AVX512F__)
  return d % 16 == 0;
#else
  (void)d;
  return false;
#endif
}

// One row, KV heads [h0, h1): their query heads attend to keys [0, ctx) in tiles of kTile keys, each tile
// read for all those KV heads before the next.
template <typename KV, typename Q>
void attend(const Q* query, const KV* k, const KV* v, const int64_t* table, int64_t ctx, int64_t h0,
            int64_t h1, const Geometry& g, float scale, Q* out, Scratch& w) {
  const int64_t d = g.head_dim, q0 = h0 * g.group, q1 = h1 * g.group;
  const bool vec512 = avx512_path(d);
  for (int64_t qh = q0; qh < q1; ++qh) {
    for (int64_t x = 0; x < d; ++x) {
      const Q value = query[qh * d + x];
      w.q[qh * d + (vec512 ? slot_of<KV>(x, d) : x)] = static_cast<float>(value);
      if constexpr (std::is_same<Q, c10::BFloat16>::value) w.qb[qh * d + x] = value.x;
    }
    std::fill_n(w.acc.begin() + qh * d, d, 0.f);
    std::fill_n(w.lv.begin() + qh * kTile, kTile, 0.f);
    w.m[qh] = kNegInf;
    w.l[qh] = 0.f;
  }
  const KV* k_rows[kTile];
  const KV* v_rows[kTile];
  for (int64_t j0 = 0; j0 < ctx; j0 += kTile) {
    const int64_t n = std::min(kTile, ctx - j0);
    tile_rows(k, v, table, j0, n, g, k_rows, v_rows);
    if (h1 - h0 > 1) touch_tile(k_rows, v_rows, n, g);
    for (int64_t h = h0; h < h1; ++h) {
      const Heads heads(w, h, g);
#if defined(__AVX512F__)
      if (vec512) {
        tile_avx512<KV, Q>(k_rows, v_rows, h * d, n, g, scale, heads);
        continue;
      }
#elif defined(KVGATE_ATTN_AVX2)
      if (d % 8 == 0) {
        tile_avx2(k_rows, v_rows, h * d, n, g, scale, heads);
        continue;
      }
#endif
      tile_scalar(k_rows, v_rows, h * d, n, g, scale, heads);
    }
  }
  for (int64_t qh = q0; qh < q1; ++qh) {
    const float* lv = w.lv.data() + qh * kTile;
    const float inv = 1.f / std::accumulate(lv, lv + kTile, w.l[qh]);
    for (int64_t x = 0; x < d; ++x) {
      out[qh * d + x] = static_cast<Q>(w.acc[qh * d + (vec512 ? slot_of<KV>(x, d) : x)] * inv);
    }
  }
}

template <typename KV, typename Q>
void run(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const int64_t* tables, const int64_t* ctx, const Geometry& g, float scale, torch::Tensor& out) {
  const Q* q = query.data_ptr<Q>();
  const KV* k = k_cache.data_ptr<KV>();
  const KV* v = v_cache.data_ptr<KV>();
  Q* o = out.data_ptr<Q>();
  const int64_t rows = query.size(0), row_stride = g.num_heads * g.head_dim;
  // whole rows once every thread has two; (row, KV head) items below that
  const int64_t per_row = rows >= 2 * at::get_num_threads() ? 1 : g.num_kv_heads;
  const int64_t span = g.num_kv_heads / per_row;
  at::parallel_for(0, rows * per_row, 1, [&](int64_t begin, int64_t end) {
    Scratch w(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / per_row, h = item % per_row * span;
      attend(q + r * row_stride, k, v, tables + r * g.max_blocks, ctx[r], h, h + span, g, scale,
             o + r * row_stride, w);
    }
  });
}

template <typename KV>
void run_for_query(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const int64_t* tables, const int64_t* ctx, const Geometry& g, float scale,
                   torch::Tensor& out) {
  if (query.scalar_type() == torch::kFloat32) {
    run<KV, float>(query, k_cache, v_cache, tables, ctx, g, scale, out);
  } else {
    run<KV, c10::BFloat16>(query, k_cache, v_cache, tables, ctx, g, scale, out);
  }
}

bool is_supported(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
}

// Every table entry a row reads must name a block of the pool: a bad table is an error, never a stray read.
void check_tables(const int64_t* tables, const int64_t* ctx, int64_t rows, const Geometry& g,
                  int64_t num_blocks) {
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ctx[r] >= 1 && ctx[r] <= g.max_blocks * g.block_size, "context length ", ctx[r],
                " of row ", r, " is out of range");
    const int64_t used = (ctx[r] + g.block_size - 1) / g.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = tables[r * g.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block table entry ", id, " of row ", r, " is out of range");
    }
  }
}

}  // namespace

// query [B, H, D] float32 or bfloat16; k_cache, v_cache [num_blocks, block_size, Hkv, D] float32 or
// bfloat16 (both the same); block_tables [B, max_blocks] int64; context_lens [B] int64 (keys per row).
// Returns [B, H, D] in the query's dtype.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "bad ranks");
  TORCH_CHECK(is_supported(query) && is_supported(k_cache), "query and cache must be float32 or bfloat16");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_tables and context_lens must be int64");
  const int64_t rows = query.size(0);
  TORCH_CHECK(block_tables.size(0) == rows && context_lens.size(0) == rows, "one table and length per row");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && k_cache.size(3) == query.size(2), "head shapes disagree");
  const Geometry geo{heads, kv_heads, heads / kv_heads, query.size(2), k_cache.size(1), block_tables.size(1)};
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  check_tables(tables, ctx, rows, geo, k_cache.size(0));
  auto out = torch::empty_like(query);
  if (rows == 0) return out;
  const float fscale = static_cast<float>(scale);
  if (k_cache.scalar_type() == torch::kFloat32) {
    run_for_query<float>(query, k_cache, v_cache, tables, ctx, geo, fscale, out);
  } else {
    run_for_query<c10::BFloat16>(query, k_cache, v_cache, tables, ctx, geo, fscale, out);
  }
  return out;
}

bool built_with_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
