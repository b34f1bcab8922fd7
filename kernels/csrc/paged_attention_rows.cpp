// Batch-invariant paged attention for the CPU: every (query row, KV head) is computed by the same
// sequence of IEEE operations whatever else is in the batch, however the prompt was chunked, and whether
// its prefix came from the cache. Built with -ffp-contract=off and without fast-math, so vectorised and
// scalar code round identically; reductions use fixed lanes and a fixed tree, and the softmax runs over
// keys in position order. Work items are independent, so the thread split cannot change any result.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int64_t l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

struct Shapes {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

// One query row and one KV head: its `group` query heads attend to keys [0, ctx) of the row's sequence.
void attend(const float* q, const float* k, const float* v, const int64_t* table, int64_t ctx,
            int64_t kv_head, const Shapes& s, float scale, float* out, std::vector<float>& scores) {
  const int64_t d = s.head_dim, g = s.group, kv_stride = s.num_kv_heads * d;
  scores.assign(static_cast<size_t>(g * ctx), 0.f);
  for (int64_t j = 0; j < ctx; ++j) {
    const int64_t slot = table[j / s.block_size] * s.block_size + j % s.block_size;
    const float* kp = k + slot * kv_stride + kv_head * d;
    for (int64_t qi = 0; qi < g; ++qi) {
      scores[qi * ctx + j] = dot(q + (kv_head * g + qi) * d, kp, d) * scale;
    }
  }
  std::vector<float> denom(g, 0.f);
  for (int64_t qi = 0; qi < g; ++qi) {
    float* row = scores.data() + qi * ctx;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < ctx; ++j) m = std::max(m, row[j]);
    float l = 0.f;
    for (int64_t j = 0; j < ctx; ++j) {
      row[j] = std::exp(row[j] - m);
      l += row[j];
    }
    denom[qi] = l;
    float* o = out + (kv_head * g + qi) * d;
    std::fill(o, o + d, 0.f);
  }
  for (int64_t j = 0; j < ctx; ++j) {
    const int64_t slot = table[j / s.block_size] * s.block_size + j % s.block_size;
    const float* vp = v + slot * kv_stride + kv_head * d;
    for (int64_t qi = 0; qi < g; ++qi) {
      const float p = scores[qi * ctx + j];
      float* o = out + (kv_head * g + qi) * d;
      for (int64_t x = 0; x < d; ++x) o[x] += p * vp[x];
    }
  }
  for (int64_t qi = 0; qi < g; ++qi) {
    float* o = out + (kv_head * g + qi) * d;
    for (int64_t x = 0; x < d; ++x) o[x] /= denom[qi];
  }
}

}  // namespace

// query [R, H, D]; k_cache, v_cache [NB, BS, KVH, D]; block_tables [S, MAXB] int64;
// row_seq [R] int64 (row -> block table row); row_ctx [R] int64 (keys the row attends to).
torch::Tensor paged_attention_rows(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor row_ctx,
                                   double scale) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32, "paged_attention_rows needs float32 query and cache");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && row_seq.dtype() == torch::kInt64 &&
                  row_ctx.dtype() == torch::kInt64, "index tensors must be int64");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && block_tables.dim() == 2, "bad ranks");
  query = query.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  block_tables = block_tables.contiguous();
  const int64_t rows = query.size(0);
  Shapes s{query.size(1), k_cache.size(2), query.size(1) / k_cache.size(2), query.size(2),
           k_cache.size(1), block_tables.size(1)};
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && k_cache.size(3) == s.head_dim, "head shapes disagree");
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* k = k_cache.data_ptr<float>();
  const float* v = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* ctx = row_ctx.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ctx[r] >= 1 && ctx[r] <= s.max_blocks * s.block_size, "row context out of range");
    TORCH_CHECK(seq[r] >= 0 && seq[r] < block_tables.size(0), "row sequence out of range");
  }
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < block_tables.numel(); ++i) {
    TORCH_CHECK(tables[i] >= 0 && tables[i] < num_blocks, "block table entry out of range");
  }
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, rows * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / s.num_kv_heads, h = item % s.num_kv_heads;
      attend(q + r * s.num_heads * s.head_dim, k, v, tables + seq[r] * s.max_blocks, ctx[r], h, s, fscale,
             o + r * s.num_heads * s.head_dim, scores);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_rows", &paged_attention_rows, "Batch-invariant paged attention (CPU, float32)");
}
