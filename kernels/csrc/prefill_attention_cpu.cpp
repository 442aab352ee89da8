// Prefill attention on CPU for every chunk of a step at once, reading K and V from the paged
// pool: each new token sees the cached tokens before it and the new ones up to itself.
//
// The torch path gathers each sequence's cached K/V out of the pool, runs torch's CPU flash
// kernel on the cached part and again (causal) on the new part, and merges the two by
// log-sum-exp, one sequence at a time from Python. torch's flash kernel calls a general sgemm
// on small tiles and reached ~120 GFLOP/s here against ~160 for a large sgemm on the same two
// cores, and a step whose chunks sit behind one shared prefix gathered that prefix once per
// chunk. Here:
//   1. Each 16-token unit of the pool that a wide chunk reads is packed once per layer (K
//      transposed to [head_dim][16], V as [16][head_dim]), however many chunks share it.
//   2. One task per (chunk, KV head, tile of up to 48 query rows) runs a flash loop over 64 keys
//      at a time with 6x16 register-blocked FMA tiles for Q.K^T and for P.V, and an online
//      softmax between them. A KV head's query heads are folded into rows (row = token * G + g),
//      so K and V are read once for the G heads that share them.
//   3. A narrow chunk (all its rows of a KV head fit one task: a short suffix after a restored
//      prefix) is not packed up front, which would cost as much as its attention: its tasks
//      split the context's keys between them, transpose each unit's K and copy its V as they
//      reach it, and their partial softmaxes are merged by their maxima.
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

#ifdef __AVX512F__
// With 512-bit vectors a unit's 16 keys (or 16 output columns) are one register: half the
// instructions of the AVX2 tiles below, on a core whose FMA units are 512 bits wide up to twice
// the rate. Each output element is summed in the same order (d, then t) as there: the results
// are bit-for-bit those of the AVX2 build.

// scores[r][0..16) = q[r] . k[..] for 6 rows against one unit's 16 keys (kt: [D][16]).
template <int D>
inline void qk_tile(const float* q, const float* kt, float* scores) {
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps();
  __m512 c3 = _mm512_setzero_ps(), c4 = _mm512_setzero_ps(), c5 = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 b = _mm512_loadu_ps(kt + d * kUnit);
    c0 = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), b, c0);
    c1 = _mm512_fmadd_ps(_mm512_set1_ps(q[D + d]), b, c1);
    c2 = _mm512_fmadd_ps(_mm512_set1_ps(q[2 * D + d]), b, c2);
    c3 = _mm512_fmadd_ps(_mm512_set1_ps(q[3 * D + d]), b, c3);
    c4 = _mm512_fmadd_ps(_mm512_set1_ps(q[4 * D + d]), b, c4);
    c5 = _mm512_fmadd_ps(_mm512_set1_ps(q[5 * D + d]), b, c5);
  }
  constexpr int S = kTileKeys;  // the scores buffer's row stride
  _mm512_storeu_ps(scores, c0);
  _mm512_storeu_ps(scores + S, c1);
  _mm512_storeu_ps(scores + 2 * S, c2);
  _mm512_storeu_ps(scores + 3 * S, c3);
  _mm512_storeu_ps(scores + 4 * S, c4);
  _mm512_storeu_ps(scores + 5 * S, c5);
}

// Two units (32 keys) at once: 12 accumulators against 6 row broadcasts per d, where one unit
// spent 6 broadcasts on 6 FMAs and the loads, not the FMAs, set the pace.
template <int D>
inline void qk_tile2(const float* q, const float* kt0, const float* kt1, float* scores) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps();
  __m512 a3 = _mm512_setzero_ps(), a4 = _mm512_setzero_ps(), a5 = _mm512_setzero_ps();
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps();
  __m512 b3 = _mm512_setzero_ps(), b4 = _mm512_setzero_ps(), b5 = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt0 + d * kUnit);
    const __m512 k1 = _mm512_loadu_ps(kt1 + d * kUnit);
    __m512 x = _mm512_set1_ps(q[d]);
    a0 = _mm512_fmadd_ps(x, k0, a0);
    b0 = _mm512_fmadd_ps(x, k1, b0);
    x = _mm512_set1_ps(q[D + d]);
    a1 = _mm512_fmadd_ps(x, k0, a1);
    b1 = _mm512_fmadd_ps(x, k1, b1);
    x = _mm512_set1_ps(q[2 * D + d]);
    a2 = _mm512_fmadd_ps(x, k0, a2);
    b2 = _mm512_fmadd_ps(x, k1, b2);
    x = _mm512_set1_ps(q[3 * D + d]);
    a3 = _mm512_fmadd_ps(x, k0, a3);
    b3 = _mm512_fmadd_ps(x, k1, b3);
    x = _mm512_set1_ps(q[4 * D + d]);
    a4 = _mm512_fmadd_ps(x, k0, a4);
    b4 = _mm512_fmadd_ps(x, k1, b4);
    x = _mm512_set1_ps(q[5 * D + d]);
    a5 = _mm512_fmadd_ps(x, k0, a5);
    b5 = _mm512_fmadd_ps(x, k1, b5);
  }
  constexpr int S = kTileKeys;
  _mm512_storeu_ps(scores, a0);
  _mm512_storeu_ps(scores + kUnit, b0);
  _mm512_storeu_ps(scores + S, a1);
  _mm512_storeu_ps(scores + S + kUnit, b1);
  _mm512_storeu_ps(scores + 2 * S, a2);
  _mm512_storeu_ps(scores + 2 * S + kUnit, b2);
  _mm512_storeu_ps(scores + 3 * S, a3);
  _mm512_storeu_ps(scores + 3 * S + kUnit, b3);
  _mm512_storeu_ps(scores + 4 * S, a4);
  _mm512_storeu_ps(scores + 4 * S + kUnit, b4);
  _mm512_storeu_ps(scores + 5 * S, a5);
  _mm512_storeu_ps(scores + 5 * S + kUnit, b5);
}

// scores of 6 rows against every unit of a tile.
template <int D>
inline void qk_tiles(const float* q, const float* const* k_units, int num_units, float* scores) {
  int u = 0;
  for (; u + 1 < num_units; u += 2)
    qk_tile2<D>(q, k_units[u], k_units[u + 1], scores + u * kUnit);
  if (u < num_units) qk_tile<D>(q, k_units[u], scores + u * kUnit);
}

// out[r][col..col+32) += sum_t p[r][t] v[t][col..col+32): two registers per row, so each
// broadcast feeds two FMAs.
template <int D>
inline void pv_tile2(const float* p, const float* const* v_units, int num_units, int col,
                     float* out) {
  __m512 a0 = _mm512_loadu_ps(out + col), b0 = _mm512_loadu_ps(out + col + 16);
  __m512 a1 = _mm512_loadu_ps(out + D + col), b1 = _mm512_loadu_ps(out + D + col + 16);
  __m512 a2 = _mm512_loadu_ps(out + 2 * D + col), b2 = _mm512_loadu_ps(out + 2 * D + col + 16);
  __m512 a3 = _mm512_loadu_ps(out + 3 * D + col), b3 = _mm512_loadu_ps(out + 3 * D + col + 16);
  __m512 a4 = _mm512_loadu_ps(out + 4 * D + col), b4 = _mm512_loadu_ps(out + 4 * D + col + 16);
  __m512 a5 = _mm512_loadu_ps(out + 5 * D + col), b5 = _mm512_loadu_ps(out + 5 * D + col + 16);
  constexpr int S = kTileKeys;
  for (int u = 0; u < num_units; ++u) {
    const float* v = v_units[u] + col;
    const float* pu = p + u * kUnit;
    for (int t = 0; t < kUnit; ++t) {
      const __m512 v0 = _mm512_loadu_ps(v + t * D);
      const __m512 v1 = _mm512_loadu_ps(v + t * D + 16);
      __m512 x = _mm512_set1_ps(pu[t]);
      a0 = _mm512_fmadd_ps(x, v0, a0);
      b0 = _mm512_fmadd_ps(x, v1, b0);
      x = _mm512_set1_ps(pu[S + t]);
      a1 = _mm512_fmadd_ps(x, v0, a1);
      b1 = _mm512_fmadd_ps(x, v1, b1);
      x = _mm512_set1_ps(pu[2 * S + t]);
      a2 = _mm512_fmadd_ps(x, v0, a2);
      b2 = _mm512_fmadd_ps(x, v1, b2);
      x = _mm512_set1_ps(pu[3 * S + t]);
      a3 = _mm512_fmadd_ps(x, v0, a3);
      b3 = _mm512_fmadd_ps(x, v1, b3);
      x = _mm512_set1_ps(pu[4 * S + t]);
      a4 = _mm512_fmadd_ps(x, v0, a4);
      b4 = _mm512_fmadd_ps(x, v1, b4);
      x = _mm512_set1_ps(pu[5 * S + t]);
      a5 = _mm512_fmadd_ps(x, v0, a5);
      b5 = _mm512_fmadd_ps(x, v1, b5);
    }
  }
  _mm512_storeu_ps(out + col, a0);
  _mm512_storeu_ps(out + col + 16, b0);
  _mm512_storeu_ps(out + D + col, a1);
  _mm512_storeu_ps(out + D + col + 16, b1);
  _mm512_storeu_ps(out + 2 * D + col, a2);
  _mm512_storeu_ps(out + 2 * D + col + 16, b2);
  _mm512_storeu_ps(out + 3 * D + col, a3);
  _mm512_storeu_ps(out + 3 * D + col + 16, b3);
  _mm512_storeu_ps(out + 4 * D + col, a4);
  _mm512_storeu_ps(out + 4 * D + col + 16, b4);
  _mm512_storeu_ps(out + 5 * D + col, a5);
  _mm512_storeu_ps(out + 5 * D + col + 16, b5);
}

// Every output column of 6 rows (D is 64 or 128: whole 32-column passes).
template <int D>
inline void pv_tiles(const float* p, const float* const* v_units, int num_units, float* out) {
  for (int col = 0; col < D; col += 32) pv_tile2<D>(p, v_units, num_units, col, out);
}

#else

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
// (v_units[u]: a unit's V packed as [16][D]; p: rows of kTileKeys probabilities, zero past the
// valid keys).
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

// scores of 6 rows against every unit of a tile.
template <int D>
inline void qk_tiles(const float* q, const float* const* k_units, int num_units, float* scores) {
  for (int u = 0; u < num_units; ++u) qk_tile<D>(q, k_units[u], scores + u * kUnit);
}

// Every output column of 6 rows.
template <int D>
inline void pv_tiles(const float* p, const float* const* v_units, int num_units, float* out) {
  for (int col = 0; col < D; col += 16) pv_tile<D>(p, v_units, num_units, col, out);
}

#endif  // __AVX512F__

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

// dst[d][t] = src[t][d] for an 8x8 tile (rows src_stride and dst_stride floats apart).
inline void transpose8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + src_stride);
  __m256 r2 = _mm256_loadu_ps(src + 2 * src_stride), r3 = _mm256_loadu_ps(src + 3 * src_stride);
  __m256 r4 = _mm256_loadu_ps(src + 4 * src_stride), r5 = _mm256_loadu_ps(src + 5 * src_stride);
  __m256 r6 = _mm256_loadu_ps(src + 6 * src_stride), r7 = _mm256_loadu_ps(src + 7 * src_stride);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + dst_stride, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * dst_stride, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * dst_stride, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// One unit's K and V for KV head h, where they lie in the pool (token_stride apart).
inline const float* unit_keys(const float* kv, int64_t unit_id, int64_t h, int64_t D,
                              const Layout& l) {
  const int64_t block = unit_id / l.units_per_block;
  const int64_t first = (unit_id % l.units_per_block) * kUnit;
  return kv + block * l.block_stride + l.layer_offset + first * l.token_stride + h * D;
}

// K^T [D][16] of one unit, and its V as [16][D]. Keys at or past valid are
// zeros: a pool slot past every context may hold anything, NaN included, and 0 * NaN is NaN.
template <int D>
inline void pack_unit(const float* k, int64_t token_stride, int64_t kv_stride, int valid,
                      float* kt, float* v_out) {
  alignas(32) float staged[kUnit * D];
  const float* src = k;
  int64_t stride = token_stride;
  if (valid < kUnit) {  // a partial unit: copy the valid keys beside zeros first
    for (int t = 0; t < kUnit; ++t) {
      if (t < valid)
        std::memcpy(staged + t * D, k + t * token_stride, D * sizeof(float));
      else
        std::memset(staged + t * D, 0, D * sizeof(float));
    }
    src = staged;
    stride = D;
  }
  for (int t = 0; t < kUnit; t += 8)
    for (int d = 0; d < D; d += 8)
      transpose8(src + t * stride + d, stride, kt + d * kUnit + t, kUnit);
  for (int t = 0; t < kUnit; ++t) {
    if (t < valid)
      std::memcpy(v_out + t * D, k + kv_stride + t * token_stride, D * sizeof(float));
    else
      std::memset(v_out + t * D, 0, D * sizeof(float));
  }
}

// The units wide chunks read into packed[u][h] = {K^T [D][16], V [16][D]}, once per step
// however many chunks share them.
template <int D>
void pack_units(const float* kv, const int64_t* unit_ids, const int64_t* unit_valid,
                const std::vector<int64_t>& wanted, const Layout& l, float* packed) {
  const int64_t per_head = 2 * kUnit * D;
  const int64_t n = static_cast<int64_t>(wanted.size());
  at::parallel_for(0, n * l.num_kv_heads, 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = wanted[task / l.num_kv_heads], h = task % l.num_kv_heads;
      float* kt = packed + (u * l.num_kv_heads + h) * per_head;
      pack_unit<D>(unit_keys(kv, unit_ids[u], h, D, l), l.token_stride, l.kv_stride,
                   static_cast<int>(unit_valid[u]), kt, kt + kUnit * D);
    }
  });
}

// What every task reads.
struct Step {
  const float* q;
  const float* kv;
  const float* packed;  // wide chunks' units; unused by in-place tasks
  const int64_t* unit_ids;
  const int64_t* unit_valid;
  const int64_t* seq_info;  // [S][3]: start, num_new, context_len
  const int64_t* seq_units;
  int64_t max_units;
  Layout l;
  float scale;
  float* out;
};

// Rows [row0, row0 + num_rows) of chunk seq's folded rows (row = token * G + g) for KV head
// `head`, over keys [key_begin, key_end). Wide chunks read pre-packed units; a narrow chunk's
// task (packs_own) packs each unit's K^T and V from the pool as it goes.
// partial == nullptr: the rows' normalised outputs go to out. Otherwise the task is one of
// several over a chunk's keys and leaves [kTaskRows][D] sums, then maxima and sums of
// exponentials, for merge_partials.
struct Task {
  int64_t seq, head, row0, num_rows, key_begin, key_end, cost;
  bool packs_own;
  float* partial;
};

constexpr int64_t kPartialFloats = static_cast<int64_t>(kTaskRows) * (128 + 2);  // D <= 128

template <int D>
void run_task(const Task& task, const Step& st) {
  alignas(32) float qbuf[kTaskRows * D];
  alignas(32) float acc[kTaskRows * D];
  alignas(32) float scores[kTaskRows * kTileKeys];
  alignas(32) float kt_local[kUnitsPerTile * kUnit * D];
  alignas(32) float v_local[kUnitsPerTile * kUnit * D];
  float row_max[kTaskRows], row_sum[kTaskRows];
  int64_t limit[kTaskRows];
  const Layout& l = st.l;
  const int64_t* info = st.seq_info + task.seq * 3;
  const int64_t start = info[0], num_new = info[1], cached = info[2] - num_new;
  const int64_t G = l.group;
  const int num_rows = static_cast<int>(task.num_rows);
  // Rows computed: num_rows rounded up to whole register tiles.
  const int tile_rows = (num_rows + kMicroRows - 1) / kMicroRows * kMicroRows;
  for (int r = 0; r < tile_rows; ++r) {
    // Padding rows repeat the last real one; their results are never written.
    const int64_t row = task.row0 + std::min(r, num_rows - 1);
    const int64_t token = row / G, head = task.head * G + row % G;
    const float* src = st.q + (start + token) * l.q_row_stride + head * l.q_head_stride;
    for (int d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * st.scale;
    limit[r] = cached + token + 1;  // keys this row sees
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
  }
  std::memset(acc, 0, sizeof(acc));
  // The last row sees the most keys.
  const int64_t key_end = std::min(task.key_end, limit[tile_rows - 1]);
  const int64_t* units = st.seq_units + task.seq * st.max_units;
  const int64_t per_head = 2 * kUnit * D;
  const float* k_units[kUnitsPerTile];
  const float* v_units[kUnitsPerTile];
  for (int64_t first = task.key_begin; first < key_end; first += kTileKeys) {
    const int tile_keys = static_cast<int>(std::min<int64_t>(kTileKeys, key_end - first));
    const int num_units = (tile_keys + kUnit - 1) / kUnit;
    if (task.packs_own) {
      // The next tile's K and V rows are fetched while this one computes: packed straight from
      // the pool, they come from memory, and the first reads of them stalled (measured when V
      // was still read in place: 22% of the kernel's samples on one load, 15 new tokens over
      // 4,096 cached). Into L2, not L1: a tile's 32 KiB of rows would push this tile's working
      // set out of L1.
      const int64_t next = first + kTileKeys;
      const int next_units = static_cast<int>(
          (std::min<int64_t>(kTileKeys, std::max<int64_t>(key_end - next, 0)) + kUnit - 1) / kUnit);
      for (int u = 0; u < next_units; ++u) {
        const float* k = unit_keys(st.kv, st.unit_ids[units[next / kUnit + u]], task.head, D, l);
        for (int t = 0; t < kUnit; ++t)
          for (int d = 0; d < D; d += 16) {
            _mm_prefetch(reinterpret_cast<const char*>(k + t * l.token_stride + d), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(k + l.kv_stride + t * l.token_stride + d),
                         _MM_HINT_T1);
          }
      }
    }
    for (int u = 0; u < num_units; ++u) {
      const int64_t unit = units[first / kUnit + u];
      if (!task.packs_own) {
        k_units[u] = st.packed + (unit * l.num_kv_heads + task.head) * per_head;
        v_units[u] = k_units[u] + kUnit * D;
        continue;
      }
      const float* k = unit_keys(st.kv, st.unit_ids[unit], task.head, D, l);
      const int valid = static_cast<int>(st.unit_valid[unit]);
      float* kt = kt_local + u * kUnit * D;
      // V is copied out too, full units included: P.V reads it once per 6-row tile, and rows
      // token_stride apart in the pool were slower to re-read than one contiguous 4 KiB
      // (measured: the pool-hit forward 8% faster with this and the L2 prefetch above).
      float* v_copy = v_local + u * kUnit * D;
      pack_unit<D>(k, l.token_stride, l.kv_stride, valid, kt, v_copy);
      k_units[u] = kt;
      v_units[u] = v_copy;
    }
    for (int r = 0; r < tile_rows; r += kMicroRows)
      qk_tiles<D>(qbuf + r * D, k_units, num_units, scores + r * kTileKeys);
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
      pv_tiles<D>(scores + r * kTileKeys, v_units, num_units, acc + r * D);
  }
  if (task.partial != nullptr) {
    std::memcpy(task.partial, acc, sizeof(float) * num_rows * D);
    std::memcpy(task.partial + kTaskRows * D, row_max, sizeof(float) * num_rows);
    std::memcpy(task.partial + kTaskRows * (D + 1), row_sum, sizeof(float) * num_rows);
    return;
  }
  for (int r = 0; r < num_rows; ++r) {
    const int64_t row = task.row0 + r;
    const int64_t token = row / G, head = task.head * G + row % G;
    float* dst = st.out + (start + token) * l.out_row_stride + head * l.out_head_stride;
    const float inv = 1.f / row_sum[r];  // > 0: every row sees at least its own key
    for (int d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

// The splits of one (narrow chunk, KV head) combined by their maxima: out = sum_s e^(m_s - M)
// acc_s / sum_s e^(m_s - M) l_s. A split whose keys a row does not see has m = -inf, l = 0.
template <int D>
void merge_partials(const Task* splits, int64_t num_splits, const Step& st) {
  const Layout& l = st.l;
  const Task& first = splits[0];
  const int64_t* info = st.seq_info + first.seq * 3;
  for (int64_t r = 0; r < first.num_rows; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < num_splits; ++s)
      top = std::max(top, splits[s].partial[kTaskRows * D + r]);
    alignas(32) float sum[D] = {};
    float total = 0.f;
    for (int64_t s = 0; s < num_splits; ++s) {
      const float* p = splits[s].partial;
      const float w = exp_nonpositive(p[kTaskRows * D + r] - top);
      total += w * p[kTaskRows * (D + 1) + r];
#pragma omp simd
      for (int d = 0; d < D; ++d) sum[d] += w * p[r * D + d];
    }
    const int64_t row = first.row0 + r;
    const int64_t token = row / l.group, head = first.head * l.group + row % l.group;
    float* dst = st.out + (info[0] + token) * l.out_row_stride + head * l.out_head_stride;
    const float inv = 1.f / total;
    for (int d = 0; d < D; ++d) dst[d] = sum[d] * inv;
  }
}

// Takes tasks[0..n) from a shared counter on torch's threads, longest first.
template <typename Fn>
void run_dynamic(int64_t n, int64_t threads, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
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
  const int64_t num_seqs = seq_info.size(0), max_units = seq_units.size(1);
  const int64_t* info = seq_info.data_ptr<int64_t>();
  const int64_t* units_ptr = seq_units.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  auto rows_of = [&](int64_t s) { return info[s * 3 + 1] * l.group; };

  // A chunk whose rows fit one task (a few new tokens) is narrow: its tasks split the keys
  // instead, so that its few rows still keep every thread busy, and read the pool in place:
  // packing its whole context first would cost as much as the attention. Wide chunks share one
  // packing of the units they read.
  const int64_t num_units = unit_ids.size(0);
  std::vector<char> wanted_flag(num_units, 0);
  int64_t narrow_heads = 0, wide_rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (rows_of(s) <= kTaskRows) {
      narrow_heads += l.num_kv_heads;
      continue;
    }
    wide_rows += rows_of(s) * l.num_kv_heads;
    const int64_t n = (info[s * 3 + 2] + kUnit - 1) / kUnit;
    for (int64_t j = 0; j < n; ++j) wanted_flag[units_ptr[s * max_units + j]] = 1;
  }
  std::vector<int64_t> wanted;
  for (int64_t u = 0; u < num_units; ++u)
    if (wanted_flag[u]) wanted.push_back(u);
  torch::Tensor packed;
  if (!wanted.empty()) {
    packed = torch::empty({num_units * l.num_kv_heads * 2 * kUnit * D},
                          kv_cache.options().dtype(torch::kFloat));
    pack_units<D>(kv_cache.data_ptr<float>(), unit_ids.data_ptr<int64_t>(),
                  unit_valid.data_ptr<int64_t>(), wanted, l, packed.data_ptr<float>());
  }

  // Wide chunks: tiles of kTaskRows rows, smaller where that leaves fewer than four tasks a
  // thread. Narrow chunks: up to eight tasks a thread between them, none under 256 keys.
  int64_t task_rows = kTaskRows;
  auto wide_tasks = [&](int64_t per_task) {
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
      if (rows_of(s) > kTaskRows) n += (rows_of(s) + per_task - 1) / per_task * l.num_kv_heads;
    return n;
  };
  while (task_rows > kMicroRows && wide_tasks(task_rows) + narrow_heads < 4 * threads)
    task_rows -= kMicroRows;
  const int64_t splits_wanted =
      narrow_heads == 0 || wide_rows > 0 ? 1 : (8 * threads + narrow_heads - 1) / narrow_heads;
  std::vector<Task> tasks;
  std::vector<std::pair<int64_t, int64_t>> split_groups;  // (first task, count) to merge
  int64_t partial_slots = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_new = info[s * 3 + 1], context = info[s * 3 + 2];
    const int64_t cached = context - num_new, rows = rows_of(s);
    for (int64_t h = 0; h < l.num_kv_heads; ++h) {
      if (rows > kTaskRows) {
        for (int64_t row0 = 0; row0 < rows; row0 += task_rows) {
          const int64_t n = std::min(rows, row0 + task_rows) - row0;
          const int64_t keys = cached + (row0 + n - 1) / l.group + 1;
          tasks.push_back({s, h, row0, n, 0, keys, n * keys, false, nullptr});
        }
        continue;
      }
      const int64_t splits = std::max<int64_t>(1, std::min(splits_wanted, context / 256));
      const int64_t per_split = (context + splits - 1) / splits;
      const int64_t span = (per_split + kTileKeys - 1) / kTileKeys * kTileKeys;  // whole tiles
      const int64_t first_task = static_cast<int64_t>(tasks.size());
      for (int64_t k0 = 0; k0 < context; k0 += span) {
        const int64_t k1 = std::min(context, k0 + span);
        tasks.push_back({s, h, 0, rows, k0, k1, rows * (k1 - k0), true, nullptr});
      }
      const int64_t count = static_cast<int64_t>(tasks.size()) - first_task;
      if (count > 1) {
        split_groups.push_back({first_task, count});
        partial_slots += count;
      }
    }
  }
  // Partial results, one slot per task of a split chunk.
  std::vector<float> partials(partial_slots * kPartialFloats);
  int64_t slot = 0;
  for (const auto& g : split_groups)
    for (int64_t i = 0; i < g.second; ++i)
      tasks[g.first + i].partial = partials.data() + kPartialFloats * slot++;
  std::vector<Task> order(tasks);
  std::stable_sort(order.begin(), order.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const Step st{query.data_ptr<float>(),   kv_cache.data_ptr<float>(),
                packed.defined() ? packed.data_ptr<float>() : nullptr,
                unit_ids.data_ptr<int64_t>(), unit_valid.data_ptr<int64_t>(),
                info, units_ptr, max_units, l, static_cast<float>(scale), out.data_ptr<float>()};
  run_dynamic(static_cast<int64_t>(order.size()), threads,
              [&](int64_t i) { run_task<D>(order[i], st); });
  at::parallel_for(0, static_cast<int64_t>(split_groups.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      merge_partials<D>(tasks.data() + split_groups[i].first, split_groups[i].second, st);
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
