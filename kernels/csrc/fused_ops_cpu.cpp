// The small per-layer ops of a Llama decoder on CPU, each one pass over its rows.
//
// In torch each of these is several ops, every one a full pass over memory plus an allocation:
// the residual add and RMSNorm (add, pow, mean, rsqrt, two multiplies), SiLU-and-multiply
// (silu, mul over a strided half) and rotary embedding followed by the K/V store (a multiply,
// two addcmul, two index_copy). On a 2,048-token prefill chunk these are memory-bound passes
// over tens of MB per layer; on a 32-row decode step they are ~25 op dispatches per layer.
// Here each is one loop over rows, parallel over torch's intra-op threads, in float32 with one
// rounding to the storage dtype where torch rounds (so float32 results match torch's to the
// order of a sum).
//
// The caller (kernels/fused_ops.py) checks shapes, dtypes and slots; these functions only
// re-check what would otherwise write out of bounds.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fast_exp.h"

namespace {

// Rows per task: enough work that a task is not all dispatch on a decode step's few rows.
constexpr int64_t kGrain = 16;

// x += delta (when given), then out = weight * (x * rsqrt(mean(x^2) + eps)), as transformers'
// LlamaRMSNorm: the normalised row rounds to the dtype before the weight multiplies it.
template <typename scalar_t>
void add_rms_norm_rows(scalar_t* x, const scalar_t* delta, const scalar_t* weight, scalar_t* out,
                       int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = x + r * hidden;
      float sum = 0.f;
      if (delta != nullptr) {
        const scalar_t* dr = delta + r * hidden;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
          const scalar_t v = static_cast<scalar_t>(static_cast<float>(xr[i]) +
                                                   static_cast<float>(dr[i]));
          xr[i] = v;
          const float f = static_cast<float>(v);
          sum += f * f;
        }
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
          const float f = static_cast<float>(xr[i]);
          sum += f * f;
        }
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      scalar_t* outr = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[i]) * inv);
        outr[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) *
                                        static_cast<float>(normed));
      }
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor x, const c10::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(),
              "contiguous [rows, hidden] input expected");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] of the input's dtype");
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta)
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous() &&
                    delta->scalar_type() == x.scalar_type(),
                "delta must be contiguous and match the input");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(),
                                has_delta ? delta->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate_up: [rows, 2 * inter] (gate then up); out: silu(gate) * up, where silu rounds to the
// dtype before the multiply, as F.silu(gate) * up does. (Loops with pragmas live in templates:
// a pragma cannot sit inside the dispatch macro's argument.)
template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = in + r * 2 * inter;
      const scalar_t* u = g + inter;
      scalar_t* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gf = static_cast<float>(g[i]);
        const scalar_t act = static_cast<scalar_t>(gf / (1.f + cachetier::exp_clamped(-gf)));
        o[i] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "contiguous [rows, 2 * intermediate] input expected");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "silu_mul",
                                  [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// Rotates each row's q and k heads in place; copies its rotated k and its v to its slot of
// the pool's layer (pool null: rotate only).
template <typename scalar_t>
void rope_store_rows(scalar_t* qkv, const float* cos, const float* sin, int64_t rows, int64_t hq,
                     int64_t hk, int64_t d, scalar_t* pool, const int64_t* slot, int64_t layer,
                     int64_t num_layers, int64_t block_size) {
  const int64_t width = (hq + 2 * hk) * d, half = d / 2, token_width = hk * d;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = qkv + r * width;
      const float* c = cos + r * half;
      const float* s = sin + r * half;
      for (int64_t h = 0; h < hq + hk; ++h) {
        scalar_t* x = row + h * d;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          x[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
          x[i + half] = static_cast<scalar_t>(x2 * c[i] + x1 * s[i]);
        }
      }
      if (pool == nullptr || slot[r] < 0) continue;
      const int64_t block = slot[r] / block_size, offset = slot[r] % block_size;
      scalar_t* k_dst =
          pool + ((block * num_layers + layer) * 2 * block_size + offset) * token_width;
      std::memcpy(k_dst, row + hq * d, token_width * sizeof(scalar_t));
      std::memcpy(k_dst + block_size * token_width, row + (hq + hk) * d,
                  token_width * sizeof(scalar_t));
    }
  });
}

// qkv: [rows, (hq + 2 hk) * d], each row q heads, k heads, v heads. Rotates the q and k heads
// in place by rotate-half RoPE (cos/sin: [rows, d / 2] float32, the first half's angles; the
// second half repeats them). Where kv_cache is given ([blocks, layers, 2, block_size, hk, d],
// contiguous, qkv's dtype), each row's rotated k and its v go to slot slots[row] of layer
// (slot = block * block_size + offset; -1 skips the row).
void rope_store(torch::Tensor qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                int64_t hq, int64_t hk, const c10::optional<torch::Tensor>& kv_cache,
                int64_t layer, const c10::optional<torch::Tensor>& slots) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "contiguous [rows, width] qkv expected");
  TORCH_CHECK(hq > 0 && hk > 0 && hq % hk == 0, "head counts must be positive, hq a multiple of hk");
  const int64_t rows = qkv.size(0), width = qkv.size(1);
  const int64_t d = width / (hq + 2 * hk), half = d / 2;
  TORCH_CHECK(d * (hq + 2 * hk) == width && d % 2 == 0, "qkv width is not (hq + 2 hk) * d");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(0) == rows && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 [rows, head_dim / 2]");
  const bool store = kv_cache.has_value() && kv_cache->defined();
  const int64_t* slot = nullptr;
  int64_t block_size = 1, num_layers = 1, num_slots = 0;
  if (store) {
    const auto& pool = *kv_cache;
    TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() &&
                    pool.scalar_type() == qkv.scalar_type() && pool.size(2) == 2 &&
                    pool.size(4) == hk && pool.size(5) == d && layer >= 0 &&
                    layer < pool.size(1),
                "the pool does not match qkv (contiguous, same dtype, hk heads of d)");
    TORCH_CHECK(slots.has_value() && slots->scalar_type() == torch::kLong &&
                    slots->is_contiguous() && slots->numel() == rows,
                "one int64 slot per row expected");
    slot = slots->data_ptr<int64_t>();
    block_size = pool.size(3);
    num_layers = pool.size(1);
    num_slots = pool.size(0) * block_size;
    // Checked before anything is written: a bad slot is an error, not a stray write.
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(slot[r] >= -1 && slot[r] < num_slots, "slot ", slot[r], " out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, qkv.scalar_type(), "rope_store", [&] {
    rope_store_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(),
                              sin.data_ptr<float>(), rows, hq, hk, d,
                              store ? kv_cache->data_ptr<scalar_t>() : nullptr, slot, layer,
                              num_layers, block_size);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm,
        "x += delta (in place, when given); returns weight * rms-normalised x", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [rows, 2 * inter] gate_up");
  m.def("rope_store", &rope_store,
        "rotate q and k heads of qkv in place; store rotated k and v into the pool's slots",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("hq"), py::arg("hk"),
        py::arg("kv_cache"), py::arg("layer"), py::arg("slots"));
}
