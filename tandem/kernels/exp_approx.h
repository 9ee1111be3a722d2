// exp for the kernels' softmax and SiLU, shared by cpu_ops.cpp and layer_ops.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tandem_kernels {

// exp(x) for any float x: clamped to the range whose result is a normal float, then Cody-Waite
// range reduction and the classic single-precision minimax polynomial (relative error about
// 1e-7). Plain arithmetic, so loops over it vectorize (the build's -fno-trapping-math lets the
// clamps become vector selects).
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer, as nearbyint does in the
  // default rounding mode, but vectorizes.
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace tandem_kernels
