// Prefill attention on CPU for every chunk of a step at once, reading K and V from the paged
// pool: each new token sees the cached tokens before it and the new ones up to itself.
//
// The torch path gathers each sequence's cached K/V out of the pool, runs torch's CPU flash
// kernel on the cached part and again (causal) on the new part, and merges the two by
// log-sum-exp, one sequence at a time from Python. torch's flash kernel calls a general sgemm
// on small tiles and reached ~120 GFLOP/s here against ~160 for a large sgemm on the same two
// cores, and a step whose chunks sit behind one shared prefix gathered that prefix once per
// chunk. Here:
//   1. Each 16-token unit of the pool that any chunk reads is packed once per layer (K
//      transposed to [head_dim][16], V as [16][head_dim]), however many chunks share it.
//   2. One task per (chunk, KV head, tile of 48 query rows) runs a flash loop over 64 keys at a
//      time with 6x16 register-blocked FMA tiles for Q.K^T and for P.V, and an online softmax
//      between them. A KV head's query heads are folded into rows (row = token * G + g), so K
//      and V are read once for the G heads that share them.
// Tasks are taken from a shared counter, longest first, because causal tiles differ in cost.
//
// Everything runs in float32; the caller only sends float32 pools and queries. Shapes outside
// what is instantiated (head_dim 64 or 128, block_size a multiple of 16, a CPU without AVX2
// and FMA) return false and the caller takes the torch path. The caller
// (kernels/native_prefill_attention.py) has checked every input; this file trusts them.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CACHETIER_PREFILL_SIMD 1
#endif

#include "fast_exp.h"

namespace {

constexpr int kUnit = 16;                 // keys per packed unit
constexpr int kUnitsPerTile = 4;          // keys per flash step: 64
constexpr int kTileKeys = kUnit * kUnitsPerTile;
constexpr int kMicroRows = 6;             // rows of one register tile
constexpr int kTaskRows = 8 * kMicroRows;  // query rows per task

#ifdef CACHETIER_PREFILL_SIMD

using cachetier::exp_nonpositive;

// scores[r][0..16) = q[r] . k[..] for 6 rows against one unit's 16 keys (kt: [D][16]).
template <int D>
inline void qk_tile(const float* q, const float* kt, float* scores) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 b0 = _mm256_loadu_ps(kt + d * kUnit);
    const __m256 b1 = _mm256_loadu_ps(kt + d * kUnit + 8);
    __m256 a = _mm256_broadcast_ss(q + d);
    c00 = _mm256_fmadd_ps(a, b0, c00);
    c01 = _mm256_fmadd_ps(a, b1, c01);
    a = _mm256_broadcast_ss(q + D + d);
    c10 = _mm256_fmadd_ps(a, b0, c10);
    c11 = _mm256_fmadd_ps(a, b1, c11);
    a = _mm256_broadcast_ss(q + 2 * D + d);
    c20 = _mm256_fmadd_ps(a, b0, c20);
    c21 = _mm256_fmadd_ps(a, b1, c21);
    a = _mm256_broadcast_ss(q + 3 * D + d);
    c30 = _mm256_fmadd_ps(a, b0, c30);
    c31 = _mm256_fmadd_ps(a, b1, c31);
    a = _mm256_broadcast_ss(q + 4 * D + d);
    c40 = _mm256_fmadd_ps(a, b0, c40);
    c41 = _mm256_fmadd_ps(a, b1, c41);
    a = _mm256_broadcast_ss(q + 5 * D + d);
    c50 = _mm256_fmadd_ps(a, b0, c50);
    c51 = _mm256_fmadd_ps(a, b1, c51);
  }
  constexpr int S = kTileKeys;  // the scores buffer's row stride
  _mm256_storeu_ps(scores, c00);
  _mm256_storeu_ps(scores + 8, c01);
  _mm256_storeu_ps(scores + S, c10);
  _mm256_storeu_ps(scores + S + 8, c11);
  _mm256_storeu_ps(scores + 2 * S, c20);
  _mm256_storeu_ps(scores + 2 * S + 8, c21);
  _mm256_storeu_ps(scores + 3 * S, c30);
  _mm256_storeu_ps(scores + 3 * S + 8, c31);
  _mm256_storeu_ps(scores + 4 * S, c40);
  _mm256_storeu_ps(scores + 4 * S + 8, c41);
  _mm256_storeu_ps(scores + 5 * S, c50);
  _mm256_storeu_ps(scores + 5 * S + 8, c51);
}

// out[r][col..col+16) += sum_t p[r][t] v[t][col..col+16) for 6 rows over the units' keys
// (v_units[u]: [16][D]; p: rows of kTileKeys probabilities, zero past the valid keys).
template <int D>
inline void pv_tile(const float* p, const float* const* v_units, int num_units, int col,
                    float* out) {
  __m256 c00 = _mm256_loadu_ps(out + col), c01 = _mm256_loadu_ps(out + col + 8);
  __m256 c10 = _mm256_loadu_ps(out + D + col), c11 = _mm256_loadu_ps(out + D + col + 8);
  __m256 c20 = _mm256_loadu_ps(out + 2 * D + col), c21 = _mm256_loadu_ps(out + 2 * D + col + 8);
  __m256 c30 = _mm256_loadu_ps(out + 3 * D + col), c31 = _mm256_loadu_ps(out + 3 * D + col + 8);
  __m256 c40 = _mm256_loadu_ps(out + 4 * D + col), c41 = _mm256_loadu_ps(out + 4 * D + col + 8);
  __m256 c50 = _mm256_loadu_ps(out + 5 * D + col), c51 = _mm256_loadu_ps(out + 5 * D + col + 8);
  constexpr int S = kTileKeys;
  for (int u = 0; u < num_units; ++u) {
    const float* v = v_units[u] + col;
    const float* pu = p + u * kUnit;
    for (int t = 0; t < kUnit; ++t) {
      const __m256 b0 = _mm256_loadu_ps(v + t * D);
      const __m256 b1 = _mm256_loadu_ps(v + t * D + 8);
      __m256 a = _mm256_broadcast_ss(pu + t);
      c00 = _mm256_fmadd_ps(a, b0, c00);
      c01 = _mm256_fmadd_ps(a, b1, c01);
      a = _mm256_broadcast_ss(pu + S + t);
      c10 = _mm256_fmadd_ps(a, b0, c10);
      c11 = _mm256_fmadd_ps(a, b1, c11);
      a = _mm256_broadcast_ss(pu + 2 * S + t);
      c20 = _mm256_fmadd_ps(a, b0, c20);
      c21 = _mm256_fmadd_ps(a, b1, c21);
      a = _mm256_broadcast_ss(pu + 3 * S + t);
      c30 = _mm256_fmadd_ps(a, b0, c30);
      c31 = _mm256_fmadd_ps(a, b1, c31);
      a = _mm256_broadcast_ss(pu + 4 * S + t);
      c40 = _mm256_fmadd_ps(a, b0, c40);
      c41 = _mm256_fmadd_ps(a, b1, c41);
      a = _mm256_broadcast_ss(pu + 5 * S + t);
      c50 = _mm256_fmadd_ps(a, b0, c50);
      c51 = _mm256_fmadd_ps(a, b1, c51);
    }
  }
  _mm256_storeu_ps(out + col, c00);
  _mm256_storeu_ps(out + col + 8, c01);
  _mm256_storeu_ps(out + D + col, c10);
  _mm256_storeu_ps(out + D + col + 8, c11);
  _mm256_storeu_ps(out + 2 * D + col, c20);
  _mm256_storeu_ps(out + 2 * D + col + 8, c21);
  _mm256_storeu_ps(out + 3 * D + col, c30);
  _mm256_storeu_ps(out + 3 * D + col + 8, c31);
  _mm256_storeu_ps(out + 4 * D + col, c40);
  _mm256_storeu_ps(out + 4 * D + col + 8, c41);
  _mm256_storeu_ps(out + 5 * D + col, c50);
  _mm256_storeu_ps(out + 5 * D + col + 8, c51);
}

// The largest of s[0..valid) over a tile's kTileKeys scores, -inf where valid is 0. The lanes at
// or past valid may hold anything (stale scores, NaN) and are blended out, not compared.
inline float masked_max(const float* s, int valid) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i limit = _mm256_set1_epi32(valid);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best = neg_inf;
  for (int t = 0; t < kTileKeys; t += 8) {
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, index));
    best = _mm256_max_ps(best, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + t), keep));
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

struct Layout {
  int64_t num_kv_heads, group, block_size, units_per_block;
  int64_t block_stride, layer_offset, kv_stride, token_stride;
  int64_t q_row_stride, q_head_stride, out_row_stride, out_head_stride;
};

// Units u of the pool into packed[u][h] = {K^T [D][16], V [16][D]}; keys at or past a unit's
// valid count are zeros, so that stale pool slots (which may hold anything, NaN included) never
// reach a product.
template <int D>
void pack_units(const float* kv, const int64_t* unit_ids, const int64_t* unit_valid,
                int64_t num_units, const Layout& l, float* packed) {
  const int64_t per_head = 2 * kUnit * D;
  at::parallel_for(0, num_units * l.num_kv_heads, 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / l.num_kv_heads, h = task % l.num_kv_heads;
      const int64_t block = unit_ids[u] / l.units_per_block;
      const int64_t first = (unit_ids[u] % l.units_per_block) * kUnit;
      const float* k = kv + block * l.block_stride + l.layer_offset + first * l.token_stride + h * D;
      const float* v = k + l.kv_stride;
      float* kt = packed + task * per_head;
      float* vp = kt + kUnit * D;
      const int valid = static_cast<int>(unit_valid[u]);
      for (int t = 0; t < kUnit; ++t) {
        if (t < valid) {
          const float* kr = k + t * l.token_stride;
          for (int d = 0; d < D; ++d) kt[d * kUnit + t] = kr[d];
          std::memcpy(vp + t * D, v + t * l.token_stride, D * sizeof(float));
        } else {
          for (int d = 0; d < D; ++d) kt[d * kUnit + t] = 0.f;
          std::memset(vp + t * D, 0, D * sizeof(float));
        }
      }
    }
  });
}

struct Task {
  int64_t seq, head, row0, num_rows, cost;
};

// One task: rows [row0, row0 + kTaskRows) of chunk seq's folded rows for KV head h.
template <int D>
void run_task(const Task& task, const float* q, const int64_t* seq_info,
              const int64_t* seq_units, int64_t max_units, const float* packed, const Layout& l,
              float scale, float* out) {
  alignas(32) float qbuf[kTaskRows * D];
  alignas(32) float acc[kTaskRows * D];
  alignas(32) float scores[kTaskRows * kTileKeys];
  float row_max[kTaskRows], row_sum[kTaskRows];
  int64_t limit[kTaskRows];
  const int64_t start = seq_info[task.seq * 3], num_new = seq_info[task.seq * 3 + 1];
  const int64_t cached = seq_info[task.seq * 3 + 2] - num_new;
  const int64_t G = l.group;
  const int num_rows = static_cast<int>(task.num_rows);
  // Rows computed: num_rows rounded up to whole register tiles.
  const int tile_rows = (num_rows + kMicroRows - 1) / kMicroRows * kMicroRows;
  for (int r = 0; r < tile_rows; ++r) {
    // Padding rows repeat the last real one; their results are never written.
    const int64_t row = task.row0 + std::min(r, num_rows - 1);
    const int64_t token = row / G, head = task.head * G + row % G;
    const float* src = q + (start + token) * l.q_row_stride + head * l.q_head_stride;
    for (int d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * scale;
    limit[r] = cached + token + 1;  // keys this row sees
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
  }
  std::memset(acc, 0, sizeof(acc));
  const int64_t keys = limit[tile_rows - 1];  // the last row sees the most
  const int64_t* units = seq_units + task.seq * max_units;
  const int64_t per_head = 2 * kUnit * D;
  const float* k_units[kUnitsPerTile];
  const float* v_units[kUnitsPerTile];
  for (int64_t first = 0; first < keys; first += kTileKeys) {
    const int tile_keys = static_cast<int>(std::min<int64_t>(kTileKeys, keys - first));
    const int num_units = (tile_keys + kUnit - 1) / kUnit;
    for (int u = 0; u < num_units; ++u) {
      k_units[u] = packed + (units[first / kUnit + u] * l.num_kv_heads + task.head) * per_head;
      v_units[u] = k_units[u] + kUnit * D;
    }
    for (int r = 0; r < tile_rows; r += kMicroRows)
      for (int u = 0; u < num_units; ++u)
        qk_tile<D>(qbuf + r * D, k_units[u], scores + r * kTileKeys + u * kUnit);
    for (int r = 0; r < tile_rows; ++r) {
      float* s = scores + r * kTileKeys;
      const int valid = static_cast<int>(std::clamp<int64_t>(limit[r] - first, 0, tile_keys));
      // A scalar max here was a latency-bound chain and took 12% of the kernel's time.
      const float tile_max = masked_max(s, valid);
      if (valid == 0) {  // nothing visible in this tile: p = 0, and the row is unchanged
        std::memset(s, 0, sizeof(float) * kTileKeys);
        continue;
      }
      const float new_max = std::max(row_max[r], tile_max);
      const float correction = exp_nonpositive(row_max[r] - new_max);
      row_max[r] = new_max;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < kTileKeys; ++t) {
        const float p = t < valid ? exp_nonpositive(s[t] - new_max) : 0.f;
        s[t] = p;
        sum += p;
      }
      row_sum[r] = row_sum[r] * correction + sum;
      if (correction != 1.f) {
        float* a = acc + r * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] *= correction;
      }
    }
    for (int r = 0; r < tile_rows; r += kMicroRows)
      for (int col = 0; col < D; col += 16)
        pv_tile<D>(scores + r * kTileKeys, v_units, num_units, col, acc + r * D);
  }
  for (int r = 0; r < num_rows; ++r) {
    const int64_t row = task.row0 + r;
    const int64_t token = row / G, head = task.head * G + row % G;
    float* dst = out + (start + token) * l.out_row_stride + head * l.out_head_stride;
    const float inv = 1.f / row_sum[r];  // > 0: every row sees at least its own key
    for (int d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

template <int D>
void prefill(const torch::Tensor& query, const torch::Tensor& kv_cache, int64_t layer,
             const torch::Tensor& unit_ids, const torch::Tensor& unit_valid,
             const torch::Tensor& seq_units, const torch::Tensor& seq_info, double scale,
             torch::Tensor& out) {
  Layout l;
  l.num_kv_heads = kv_cache.size(4);
  l.group = query.size(1) / l.num_kv_heads;
  l.block_size = kv_cache.size(3);
  l.units_per_block = l.block_size / kUnit;
  l.token_stride = l.num_kv_heads * D;
  l.kv_stride = l.block_size * l.token_stride;
  l.layer_offset = layer * 2 * l.kv_stride;
  l.block_stride = kv_cache.size(1) * 2 * l.kv_stride;
  l.q_row_stride = query.stride(0);
  l.q_head_stride = query.stride(1);
  l.out_row_stride = out.stride(0);
  l.out_head_stride = out.stride(1);
  const int64_t num_units = unit_ids.size(0);
  auto packed = torch::empty({num_units * l.num_kv_heads * 2 * kUnit * D},
                             kv_cache.options().dtype(torch::kFloat));
  float* packed_ptr = packed.data_ptr<float>();
  pack_units<D>(kv_cache.data_ptr<float>(), unit_ids.data_ptr<int64_t>(),
                unit_valid.data_ptr<int64_t>(), num_units, l, packed_ptr);

  const int64_t num_seqs = seq_info.size(0), max_units = seq_units.size(1);
  const int64_t* info = seq_info.data_ptr<int64_t>();
  // Tiles of kTaskRows rows, smaller where that leaves fewer than four tasks a thread (a short
  // chunk's few rows would otherwise run on one thread while the other waits).
  const int64_t threads = at::get_num_threads();
  int64_t task_rows = kTaskRows;
  auto count_tasks = [&](int64_t per_task) {
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
      n += (info[s * 3 + 1] * l.group + per_task - 1) / per_task * l.num_kv_heads;
    return n;
  };
  while (task_rows > kMicroRows && count_tasks(task_rows) < 4 * threads) task_rows -= kMicroRows;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_new = info[s * 3 + 1], cached = info[s * 3 + 2] - num_new;
    const int64_t rows = num_new * l.group;
    for (int64_t h = 0; h < l.num_kv_heads; ++h)
      for (int64_t row0 = 0; row0 < rows; row0 += task_rows) {
        const int64_t last = std::min(rows, row0 + task_rows) - 1;
        tasks.push_back({s, h, row0, last - row0 + 1, cached + last / l.group + 1});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const float* q_ptr = query.data_ptr<float>();
  const int64_t* units_ptr = seq_units.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // One range element per thread; each takes tasks from the counter until none is left.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < num_tasks; i = next++)
      run_task<D>(tasks[i], q_ptr, info, units_ptr, max_units, packed_ptr, l, fscale, out_ptr);
  });
}

#endif  // CACHETIER_PREFILL_SIMD

// False where this build or these shapes are not covered (the caller takes the torch path).
bool paged_prefill_attention(const torch::Tensor& query, const torch::Tensor& kv_cache,
                             int64_t layer, const torch::Tensor& unit_ids,
                             const torch::Tensor& unit_valid, const torch::Tensor& seq_units,
                             const torch::Tensor& seq_info, double scale, torch::Tensor out) {
#ifdef CACHETIER_PREFILL_SIMD
  TORCH_CHECK(kv_cache.is_contiguous() && query.stride(2) == 1 && out.stride(2) == 1,
              "a contiguous pool and unit-stride head_dim expected");
  TORCH_CHECK(unit_ids.is_contiguous() && unit_valid.is_contiguous() &&
                  seq_units.is_contiguous() && seq_info.is_contiguous(),
              "contiguous plan tensors expected");
  if (query.scalar_type() != torch::kFloat || kv_cache.scalar_type() != torch::kFloat ||
      out.scalar_type() != torch::kFloat || kv_cache.size(3) % kUnit != 0)
    return false;
  const int64_t head_dim = query.size(2);
  if (head_dim == 64) {
    prefill<64>(query, kv_cache, layer, unit_ids, unit_valid, seq_units, seq_info, scale, out);
    return true;
  }
  if (head_dim == 128) {
    prefill<128>(query, kv_cache, layer, unit_ids, unit_valid, seq_units, seq_info, scale, out);
    return true;
  }
#endif
  return false;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal attention of a step's prefill chunks over the paged pool (CPU, float32); "
        "false where unsupported");
}
