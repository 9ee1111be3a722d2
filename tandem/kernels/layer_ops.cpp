// The per-token glue of a decoder layer: RMSNorm, SiLU-and-multiply, rotary embedding.
//
// Between its matrix products a decoder layer runs a handful of elementwise and reduction steps.
// PyTorch runs each as several operators (an RMSNorm is a square, a mean, an add, a reciprocal
// square root and two products, each a pass over the row and a dispatch from Python), which at one
// or a few tokens per step costs more than the arithmetic: tens of microseconds a call, dozens of
// calls a layer. Here each is one pass in one call, in float32 arithmetic whatever the storage
// type, rounding to bfloat16 where the reference implementation rounds (so a bfloat16 result
// differs from PyTorch's only by the order of a sum). A float32 result is not bit-identical to
// PyTorch's (sum order, fused multiply-adds): the model uses these only where it is not promised
// to match `transformers` exactly (tandem/model/fused_ops.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "exp_approx.h"
#include "kernel_util.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using tandem_kernels::exp_clamped;

// Rows that together hold fewer elements than this run on the calling thread: waking the thread
// pool costs more than the pass itself.
constexpr int64_t kParallelElems = 1 << 15;

// bfloat16 is handled as its bits (uint16_t) so that the loops below vectorize: at::BFloat16's
// conversions branch.
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_float(v); }

template <typename S>
inline S narrow(float v);
template <>
inline float narrow<float>(float v) {
  return v;
}
template <>
inline uint16_t narrow<uint16_t>(float v) {  // round to nearest even, NaN stays NaN (as PyTorch)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return v != v ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// The value as the storage type holds it, back in float32.
template <typename S>
inline float rounded(float v) {
  return widen(narrow<S>(v));
}

// The storage type of a tensor's elements: float, or bfloat16's bits.
template <typename S>
S* elements(const at::Tensor& x) {
  return reinterpret_cast<S*>(x.data_ptr());
}

// Runs body(r0, r1) over the rows, on the calling thread or the pool, with denormals flushed on
// whichever threads run it.
template <typename F>
void for_rows(int64_t rows, int64_t width, F&& body) {
  const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(width, 1));
  auto flushed = [&body](int64_t r0, int64_t r1) {
    tandem_kernels::FlushDenormals flush;
    body(r0, r1);
  };
  if (rows <= grain) {
    flushed(0, rows);
    return;
  }
  at::parallel_for(0, rows, grain, flushed);
}

// Up to three dimensions [A, B, D] with D contiguous, as a list of rows: the offset of row r.
struct Rows {
  int64_t count, width, inner, s0, s1;
  explicit Rows(const at::Tensor& x)
      : count(1), width(x.size(-1)), inner(1), s0(0), s1(0) {
    if (x.dim() >= 2) {
      count = x.size(0);
      s0 = x.stride(0);
    }
    if (x.dim() == 3) {
      inner = x.size(1);
      count *= inner;
      s1 = x.stride(1);
    }
  }
  int64_t offset(int64_t r) const { return (r / inner) * s0 + (r % inner) * s1; }
};

void check_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 3, op, ": expected 1 to 3 dimensions, got ", x.dim());
  TORCH_CHECK(x.stride(-1) == 1, op, ": the last dimension must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only, got ", x.scalar_type());
}

// A norm's weight [D]: the model's own (float32 or bfloat16, contiguous) read in place; anything
// else once converted.
at::Tensor norm_weight(const char* op, const at::Tensor& weight, int64_t D) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, op, ": weight must be [", D, "]");
  const bool as_is = weight.is_contiguous() &&
                     (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16);
  return as_is ? weight : weight.to(at::kFloat).contiguous();
}

// W: the weight's storage type (float, or bfloat16's bits), read as it is: no per-call copy.
template <typename E, typename W>
void rms_norm_impl(const at::Tensor& x, const W* w, float offset, double eps, bool cast_first, at::Tensor& out) {
  const Rows rows(x);
  const int64_t D = rows.width;
  const E* xp = elements<E>(x);
  E* op = elements<E>(out);
  const float epsf = static_cast<float>(eps);
  for_rows(rows.count, D, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const E* xr = xp + rows.offset(r);
      E* o = op + r * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) ss += widen(xr[d]) * widen(xr[d]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + epsf);
      if (cast_first) {  // Llama: the normalized row is cast to the storage type, then weighted
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = narrow<E>((widen(w[d]) + offset) * rounded<E>(widen(xr[d]) * inv));
      } else {  // Gemma: weighted in float32, then cast
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = narrow<E>(widen(xr[d]) * inv * (widen(w[d]) + offset));
      }
    }
  });
}

template <typename E>
void rms_norm_typed(const at::Tensor& x, const at::Tensor& w, float offset, double eps, bool cast_first,
                    at::Tensor& out) {
  if (w.scalar_type() == at::kFloat) {
    rms_norm_impl<E, float>(x, w.data_ptr<float>(), offset, eps, cast_first, out);
  } else {
    rms_norm_impl<E, uint16_t>(x, elements<uint16_t>(w), offset, eps, cast_first, out);
  }
}

// RMSNorm of each row of x ([D], [T, D] or [T, H, D], rows may be strided) times (weight +
// weight_offset); returns a contiguous tensor of x's shape and dtype. cast_first: round the
// normalized row to x's dtype before the weight multiplies it (Llama's order) rather than after
// (Gemma's).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset,
                    bool cast_first) {
  const char* op = "tandem rms_norm";
  check_rows(op, x);
  const at::Tensor w = norm_weight(op, weight, x.size(-1));
  const float offset = static_cast<float>(weight_offset);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_typed<float>(x, w, offset, eps, cast_first, out);
  } else {
    rms_norm_typed<uint16_t>(x, w, offset, eps, cast_first, out);
  }
  return out;
}

// residual + x into new_residual (rounded to the storage type, as PyTorch's add), then RMSNorm of
// that sum into out, one pass over each row (Llama's order: the normalized row cast first).
template <typename E, typename W>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const W* w, float offset, double eps,
                       at::Tensor& out, at::Tensor& new_residual) {
  const int64_t T = x.size(0), D = x.size(1), sx = x.stride(0), sr = residual.stride(0);
  const E* xp = elements<E>(x);
  const E* rp = elements<E>(residual);
  E* op = elements<E>(out);
  E* np = elements<E>(new_residual);
  const float epsf = static_cast<float>(eps);
  for_rows(T, D, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const E* xr = xp + r * sx;
      const E* rr = rp + r * sr;
      E* n = np + r * D;
      E* o = op + r * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) {
        const float v = rounded<E>(widen(rr[d]) + widen(xr[d]));
        n[d] = narrow<E>(v);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + epsf);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = narrow<E>((widen(w[d]) + offset) * rounded<E>(widen(n[d]) * inv));
    }
  });
}

// (RMSNorm(residual + x) * (weight + weight_offset), residual + x) for [T, D] rows of one dtype: a
// decoder layer's residual add fused with the next norm, the add rounded as PyTorch's.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, double weight_offset) {
  const char* op = "tandem add_rms_norm";
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), op, ": x and residual must be [T, D] of one shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), op, ": x and residual must share a dtype");
  check_rows(op, x);
  check_rows(op, residual);
  const at::Tensor w = norm_weight(op, weight, x.size(-1));
  const float offset = static_cast<float>(weight_offset);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = at::empty(x.sizes(), x.options());
  auto run = [&](auto elem) {
    using E = decltype(elem);
    if (w.scalar_type() == at::kFloat)
      add_rms_norm_impl<E, float>(x, residual, w.data_ptr<float>(), offset, eps, out, sum);
    else
      add_rms_norm_impl<E, uint16_t>(x, residual, elements<uint16_t>(w), offset, eps, out, sum);
  };
  if (x.scalar_type() == at::kFloat)
    run(float{});
  else
    run(uint16_t{});
  return {out, sum};
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// bfloat16 bits of each lane in the low half (round to nearest even; NaN stays NaN, as narrow()).
inline __m512i bf16_bits16(__m512 v) {
#if defined(__AVX512BF16__)
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
#endif
}
inline __m512 rounded16(const float*, __m512 v) { return v; }
inline __m512 rounded16(const uint16_t*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
#else
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits16(v)));
#endif
}

// One row of silu(gate) * up, 16 lanes at a time: the scalar loop's math, except for silu16's
// reciprocal (tandem/kernels/exp_approx.h). The AMX gate/up product's fused form
// (gemm_amx_bf16_silu_mul, amx_ops.cpp) runs the same steps on its results.
template <typename E>
void silu_mul_row16(const E* g, const E* u, E* o, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = first_lanes(std::min<int64_t>(16, I - i));
    const __m512 s = rounded16(g, tandem_kernels::silu16(load16(g + i, m)));
    store16(o + i, _mm512_mul_ps(s, load16(u + i, m)), m);
  }
}
#endif

template <typename E>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t T = gate_up.size(0), I = out.size(1), stride = gate_up.stride(0);
  const E* gp = elements<E>(gate_up);
  E* op = elements<E>(out);
  for_rows(T, I, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const E* g = gp + t * stride;
      const E* u = g + I;
      E* o = op + t * I;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      silu_mul_row16(g, u, o, I);
#else
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float a = widen(g[i]);
        // silu rounds to the storage type before the product, as two PyTorch operators would.
        const float s = rounded<E>(a / (1.f + exp_clamped(-a)));
        o[i] = narrow<E>(s * widen(u[i]));
      }
#endif
    }
  });
}

// gate_up [T, 2I] (the fused gate and up projections, gate first) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const char* op = "tandem silu_mul";
  check_rows(op, gate_up);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op, ": expected [T, 2 * intermediate]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gate_up, out);
  } else {
    silu_mul_impl<uint16_t>(gate_up, out);
  }
  return out;
}

template <typename E>
void rope_impl(at::Tensor& x, const float* cos, const float* sin, int64_t R) {
  const int64_t T = x.size(0), H = x.size(1), s0 = x.stride(0), s1 = x.stride(1), half = R / 2;
  E* xp = elements<E>(x);
  for_rows(T * H, R, [&](int64_t r0, int64_t r1) {
    std::vector<float> v(R);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / H;
      E* row = xp + t * s0 + (r % H) * s1;
      const float* c = cos + t * R;
      const float* s = sin + t * R;
      for (int64_t d = 0; d < R; ++d) v[d] = widen(row[d]);
      // Neox pairing: element d turns with d + R/2; `sin` has the first half's sign folded in.
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) row[d] = narrow<E>(v[d] * c[d] + v[d + half] * s[d]);
#pragma omp simd
      for (int64_t d = half; d < R; ++d) row[d] = narrow<E>(v[d] * c[d] + v[d - half] * s[d]);
    }
  });
}

// Rotates x [T, H, D] in place (rows may be strided): the first R elements of each head by the
// token's cos and sign-folded sin rows, cos and sin float32 [T, R] (or [T, 1, R]); the rest of a
// head (partial rotary) is left as is.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "tandem rope_";
  check_rows(op, x);
  TORCH_CHECK(x.dim() == 3, op, ": x must be [tokens, heads, head_dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              op, ": cos and sin must be contiguous float32");
  const int64_t T = x.size(0), R = cos.size(-1);
  TORCH_CHECK(cos.numel() == T * R && sin.numel() == T * R, op, ": cos and sin need one row per token");
  TORCH_CHECK(R % 2 == 0 && R <= x.size(2), op, ": the rotary width must be even and at most head_dim");
  if (x.scalar_type() == at::kFloat) {
    rope_impl<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), R);
  } else {
    rope_impl<uint16_t>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), R);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float weight_offset, bool cast_first) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float weight_offset) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
}
