// e^x in float32 that GCC vectorises (std::exp in a loop stays scalar without -ffast-math),
// shared by the CPU kernels in this folder.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cachetier {

// x = n ln2 + r with |r| <= ln2/2; e^r by its Taylor polynomial to r^6 (relative error below
// 2e-7, float32's own rounding); 2^n written into the exponent bits. The caller keeps x in
// [-87.3, 88.3], where 2^n is a normal float. NaN stays NaN.
inline float exp_in_range(float x) {
  const float n = std::floor(x * 1.4426950408889634f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// e^x for x <= 0 (scores minus their running max). Below -87.3 the result is 2^-126 times
// e^r, which a softmax's sum swamps.
inline float exp_nonpositive(float x) { return exp_in_range(x < -87.3f ? -87.3f : x); }

// e^x for any x, clamped to float32's normal range at both ends (SiLU's e^-x: a huge result
// divides to 0, a tiny one adds nothing to 1).
inline float exp_clamped(float x) {
  return exp_in_range(x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x));
}

}  // namespace cachetier
