// Decode attention on CPU that reads K and V where they lie in the paged pool.
//
// The torch path copies each sequence's blocks out of the pool (index_select), then runs two
// matmuls, once per sequence and layer from Python. Here one task per (sequence, KV head)
// walks its block table and folds each block into an online softmax, so nothing is copied and
// the Python loop is gone. Scores, softmax and the weighted sum run in float32.
//
// The group size (query heads per KV head) and head_dim are template parameters, so that the
// group's accumulators stay in vector registers and every inner loop has a fixed trip count;
// shapes outside the instantiated set return an undefined tensor and the caller takes the
// torch path. The caller (kernels/native_paged_attention.py) has checked every input as
// kernels.paged_attention does; this file only trusts them.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace {

using cachetier::exp_nonpositive;

struct Pool {
  int64_t block_stride, layer_offset, kv_stride, token_stride, head_stride, block_size;
};

// One (sequence, KV head): its G query heads over the context_len tokens of the blocks in
// table. Writes the G normalised outputs (float32, [G][D]) and their log-sum-exps; an empty
// context gives zeros and -inf, which merge with another part's result as "no keys".
template <typename scalar_t, int G, int D>
void attend_one(const scalar_t* q_in, const scalar_t* kv, const int64_t* table,
                int64_t context_len, const Pool& pool, float scale, float* out, float* lse) {
  constexpr int kMaxBlock = 256;  // block_size above this takes the torch path
  float q[G][D], acc[G][D], scores[G][kMaxBlock];
  float running_max[G], running_sum[G];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < D; ++i) {
      q[g][i] = static_cast<float>(q_in[g * D + i]) * scale;
      acc[g][i] = 0.f;
    }
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.f;
  }
  const int64_t block_size = pool.block_size;
  const int64_t num_blocks = (context_len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int n = static_cast<int>(std::min(block_size, context_len - b * block_size));
    const scalar_t* k_base = kv + table[b] * pool.block_stride + pool.layer_offset;
    const scalar_t* v_base = k_base + pool.kv_stride;
    for (int t = 0; t < n; ++t) {
      const scalar_t* k = k_base + t * pool.token_stride;
      // One plain reduction per query head: GCC vectorises this form. The array-section
      // reduction over all G heads at once that it replaced ran scalar, and the kernel was
      // compute-bound (measured, 32 rows of ~600 tokens, 30 layers, 2 threads: 78 -> 48 ms,
      // about this machine's memory bandwidth; holding a head's query in registers across a
      // block's keys, or a task walking all KV heads of a block, measured slower).
      for (int g = 0; g < G; ++g) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < D; ++i) sum += q[g][i] * static_cast<float>(k[i]);
        scores[g][t] = sum;
      }
    }
    for (int g = 0; g < G; ++g) {
      float block_max = scores[g][0];
      for (int t = 1; t < n; ++t) block_max = std::max(block_max, scores[g][t]);
      const float new_max = std::max(running_max[g], block_max);
      // First block: running_max is -inf, the correction 0, and acc and the sum are 0 anyway.
      const float correction = exp_nonpositive(running_max[g] - new_max);
      running_max[g] = new_max;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < n; ++t) {
        scores[g][t] = exp_nonpositive(scores[g][t] - new_max);
        sum += scores[g][t];
      }
      running_sum[g] = running_sum[g] * correction + sum;
#pragma omp simd
      for (int i = 0; i < D; ++i) acc[g][i] *= correction;
    }
    for (int t = 0; t < n; ++t) {
      const scalar_t* v = v_base + t * pool.token_stride;
      for (int g = 0; g < G; ++g) {
        const float p = scores[g][t];
#pragma omp simd
        for (int i = 0; i < D; ++i) acc[g][i] += p * static_cast<float>(v[i]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;
    for (int i = 0; i < D; ++i) out[g * D + i] = acc[g][i] * inv;
    lse[g] = running_sum[g] > 0.f ? running_max[g] + std::log(running_sum[g])
                                  : -std::numeric_limits<float>::infinity();
  }
}

// Every (row, KV head) over its blocks from column first_block on; the rows' contexts count
// from there. out_f32 / lse: [batch, num_heads, D] and [batch, num_heads] when given (the
// caller merges them with another part); otherwise out gets the result in scalar_t.
template <typename scalar_t, int G, int D>
void decode(const torch::Tensor& query, const torch::Tensor& kv_cache, int64_t layer,
            const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
            int64_t first_block, torch::Tensor& out, float* out_f32, float* lse_out) {
  const int64_t batch = query.size(0), num_heads = query.size(1);
  // kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous.
  const int64_t block_size = kv_cache.size(3), num_kv_heads = kv_cache.size(4);
  Pool pool;
  pool.block_size = block_size;
  pool.head_stride = D;
  pool.token_stride = num_kv_heads * D;
  pool.kv_stride = block_size * pool.token_stride;
  pool.layer_offset = layer * 2 * pool.kv_stride;
  pool.block_stride = kv_cache.size(1) * 2 * pool.kv_stride;
  const int64_t table_stride = block_tables.size(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* kv_ptr = kv_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out_f32 == nullptr ? out.data_ptr<scalar_t>() : nullptr;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    float result[G * D], lse[G];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / num_kv_heads, kv_head = task % num_kv_heads;
      // Query head h = kv_head * G + g reads KV head kv_head.
      const int64_t first_head = row * num_heads + kv_head * G;
      const int64_t own_len = lens[row] - first_block * block_size;
      attend_one<scalar_t, G, D>(q_ptr + first_head * D, kv_ptr + kv_head * D,
                                 tables + row * table_stride + first_block, own_len, pool,
                                 fscale, result, lse);
      if (out_f32 != nullptr) {
        std::memcpy(out_f32 + first_head * D, result, sizeof(result));
        std::memcpy(lse_out + first_head, lse, sizeof(lse));
      } else {
        for (int i = 0; i < G * D; ++i)
          out_ptr[first_head * D + i] = static_cast<scalar_t>(result[i]);
      }
    }
  });
}

struct Outputs {
  torch::Tensor out;   // scalar_t result, or undefined
  float* out_f32;      // or float32 result and log-sum-exps
  float* lse;
};

template <typename scalar_t, int D>
bool dispatch_group(int64_t group, const torch::Tensor& query, const torch::Tensor& kv_cache,
                    int64_t layer, const torch::Tensor& tables, const torch::Tensor& lens,
                    double scale, int64_t first_block, Outputs& o) {
  switch (group) {
#define CACHETIER_GROUP(G)                                                         \
  case G:                                                                          \
    decode<scalar_t, G, D>(query, kv_cache, layer, tables, lens, scale, first_block, \
                           o.out, o.out_f32, o.lse);                                 \
    return true;
    CACHETIER_GROUP(1)
    CACHETIER_GROUP(2)
    CACHETIER_GROUP(3)
    CACHETIER_GROUP(4)
    CACHETIER_GROUP(5)
    CACHETIER_GROUP(6)
    CACHETIER_GROUP(7)
    CACHETIER_GROUP(8)
#undef CACHETIER_GROUP
    default:
      return false;
  }
}

bool supported(const torch::Tensor& query, const torch::Tensor& kv_cache) {
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous(), "contiguous inputs expected");
  const int64_t head_dim = query.size(2), group = query.size(1) / kv_cache.size(4);
  return kv_cache.size(3) <= 256 && (head_dim == 64 || head_dim == 128) && group >= 1 &&
         group <= 8;
}

bool run(const torch::Tensor& query, const torch::Tensor& kv_cache, int64_t layer,
         const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
         int64_t first_block, Outputs& o) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong &&
                  context_lens.scalar_type() == torch::kLong,
              "int64 block_tables and context_lens expected");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t head_dim = query.size(2), group = query.size(1) / kv_cache.size(4);
  bool done = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "decode", [&] {
    if (head_dim == 64)
      done = dispatch_group<scalar_t, 64>(group, query, kv_cache, layer, tables, lens, scale,
                                          first_block, o);
    else if (head_dim == 128)
      done = dispatch_group<scalar_t, 128>(group, query, kv_cache, layer, tables, lens, scale,
                                           first_block, o);
  });
  return done;
}

// The whole context; an undefined tensor where the shape is not instantiated (the caller
// falls back).
torch::Tensor paged_attention_decode(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                     int64_t layer, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  if (!supported(query, kv_cache)) return torch::Tensor();
  Outputs o{torch::empty_like(query), nullptr, nullptr};
  return run(query, kv_cache, layer, block_tables, context_lens, scale, 0, o) ? o.out
                                                                             : torch::Tensor();
}

// The context from block column first_block on, as float32 outputs and log-sum-exps for a
// merge with the part before it; an empty list where the shape is not instantiated.
std::vector<torch::Tensor> paged_attention_decode_part(
    const torch::Tensor& query, const torch::Tensor& kv_cache, int64_t layer,
    const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
    int64_t first_block) {
  if (!supported(query, kv_cache)) return {};
  auto out = torch::empty(query.sizes(), query.options().dtype(torch::kFloat));
  auto lse = torch::empty({query.size(0), query.size(1)}, out.options());
  Outputs o{torch::Tensor(), out.data_ptr<float>(), lse.data_ptr<float>()};
  if (!run(query, kv_cache, layer, block_tables, context_lens, scale, first_block, o)) return {};
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "Decode attention reading the paged pool in place (CPU); undefined where unsupported");
  m.def("paged_attention_decode_part", &paged_attention_decode_part,
        "The same from a block column on: float32 outputs and log-sum-exps, for a merge");
}
