// exp for the kernels' softmax and SiLU, shared by cpu_ops.cpp and layer_ops.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// exp_clamped's steps on 16 lanes.
inline __m512 exp_clamped16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 big = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big), big);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p * 2^n, n integral and in [-126, 127]
}

// silu(a) = a / (1 + exp(-a)) on 16 lanes, 1 / (1 + e) as a 14-bit reciprocal estimate refined by
// one Newton step (within a float's rounding of the quotient) instead of a division, whose
// throughput bounded the loops over it (a 512-wide divide per 16 elements). Run it with denormals
// flushed (FlushDenormals): below a of about -87 the reciprocal is one.
inline __m512 silu16(__m512 a) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 d = _mm512_add_ps(one, exp_clamped16(_mm512_sub_ps(_mm512_setzero_ps(), a)));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, r, one), r, r);
  return _mm512_mul_ps(a, r);
}

// 2^t for t <= 0, to about 3e-6 relative error: a softmax's probabilities, which the attention
// kernels round to bfloat16 (relative step 2^-8) before P . V. Half the instructions of
// exp_clamped16: no range reduction by ln 2 (the caller folds log2(e) into its scale) and a
// degree-4 polynomial for 2^f on [-1/2, 1/2] (relative least squares, Lawson-weighted toward
// minimax). t is clamped at -125 so that every result is a normal float (a denormal would cost a
// microcode assist; anything below 2^-125 is nothing to a softmax whose largest term is 1).
inline __m512 exp2_nonpositive16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009570101276040077f), f, _mm512_set1_ps(0.05591786280274391f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240247443318367f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931217908859253f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999992847442627f));
  return _mm512_scalef_ps(p, n);
}
#endif

// Denormal results flushed to zero (and denormal inputs read as zero) while in scope, on the
// calling thread. A vectorized loop over exp_clamped evaluates the clamped branch in every lane and
// blends: for SiLU that branch is `a / (1 + exp(88))`, a denormal for any ordinary `a`, and each
// denormal costs a microcode assist, many times the arithmetic it replaces. What is flushed is
// below 1.2e-38, nothing a bfloat16 or float32 activation keeps.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  unsigned saved_;
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace tandem_kernels
