// Tandem's CPU kernels: few-row products that read the weights at memory speed, and attention
// over the paged KV cache for short queries.
//
// A decoding stream multiplies one activation row (a few, when verifying drafts or batching a
// handful of streams) by every weight matrix, so its speed is the speed at which the weights
// stream from memory. oneDNN's bfloat16 product for one to four rows and its float32 product for
// three to eight run well below the memory bandwidth, and PyTorch's int8 dynamic-quantization path
// spends a good part of each small call quantizing in separate ATen operators. These kernels stream
// four weight rows at a time with software prefetch, multiply with the CPU's vector dot-product
// instructions (AVX-512 FMA, AVX512-BF16 `vdpbf16ps`, AVX512-VNNI `vpdpbusd`; AVX2 FMA and
// `vpmaddubsw` without AVX-512) for up to six activation rows per sweep, and do quantization and
// epilogue in the same call.
//
// Each product is registered (torch.ops.tandem.*) only when the host CPU has its instructions;
// tandem/kernels/__init__.py builds this file with -march=native and the Python callers keep their
// pure-torch paths for everything else.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "exp_approx.h"
#include "kernel_util.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Rows beyond this are better served by the libraries' blocked GEMMs.
constexpr int64_t kMaxRows = 16;

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, op, ": x and w must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), op, ": x has ", x.size(1), " columns, w has ", w.size(1));
  TORCH_CHECK(x.size(0) <= kMaxRows, op, ": at most ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(w.is_contiguous(), op, ": w must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
}

#if defined(__AVX512F__)
// How one weight type is multiplied: elements per instruction, loads, the multiply-accumulate and
// the final horizontal sum. `dot_rows` below is written once against these.
struct F32Dot {  // float32 x float32, fused multiply-add
  using X = float;
  using W = float;
  using Vec = __m512;
  using Acc = __m512;
  using Out = float;
  using Mask = __mmask16;
  static constexpr int64_t kStep = 16;
  static constexpr int kSweep = 6;
  static Mask tail_mask(int64_t tail) { return static_cast<Mask>(tail >= kStep ? ~0ull : (1ull << tail) - 1); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
  static Out sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The AVX2 forms, for CPUs without AVX-512 (AMD Zen 2/3 among them): 8 floats per instruction and
// 16 vector registers, so 2 activation rows x 4 weight rows of accumulators per sweep. A tail mask
// is a vector of lanes (all ones where loaded), as `vmaskmovps` takes it.
struct F32Dot8 {  // float32 x float32, fused multiply-add
  using X = float;
  using W = float;
  using Vec = __m256;
  using Acc = __m256;
  using Out = float;
  using Mask = __m256i;
  static constexpr int64_t kStep = 8;
  static constexpr int kSweep = 2;
  static Mask tail_mask(int64_t tail) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tail)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(Mask m, const float* p) { return _mm256_maskload_ps(p, m); }
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm256_fmadd_ps(x, w, acc); }
  static Out sum(Acc acc) { return hsum256(acc); }
};

// float32 activations x int8 weights widened in registers (one scale per output row, applied in
// the epilogue): a weight-only int8 product that reads a quarter of float32's bytes, for CPUs
// without VNNI, where quantizing the activations buys nothing.
struct W8F32Dot8 : F32Dot8 {  // the activations' side, accumulation and sums as F32Dot8
  using W = int8_t;
  using F32Dot8::load;
  static Vec load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static Vec load(Mask m, const int8_t* p) {  // a row's last < 8 weights: no byte-masked load in AVX2
    alignas(32) int32_t lanes[8];
    alignas(32) int32_t on[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(on), m);
    for (int i = 0; i < 8; ++i) lanes[i] = on[i] ? p[i] : 0;
    return _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(lanes)));
  }
};
#endif

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// Signed 8-bit activations x signed 8-bit weights without VNNI. `vpmaddubsw` multiplies unsigned
// bytes by signed ones, so each activation's sign moves onto its weight (|x| * (sign(x) w)); with
// both in [-127, 127] a pair of products sums to at most 2 * 127 * 127 < 2^15 (no saturation), and
// `vpmaddwd` by ones widens the pairs to int32: the exact integer dot product VNNI gives.
struct S8S8Dot8 {
  using X = int8_t;
  using W = int8_t;
  using Vec = __m256i;
  using Acc = __m256i;
  using Out = int32_t;
  using Mask = int64_t;  // bytes present in a row's last step (kStep: all)
  static constexpr int64_t kStep = 32;
  static constexpr int kSweep = 2;
  static Mask tail_mask(int64_t tail) { return std::min(tail, kStep); }
  static Vec load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Vec load(Mask m, const int8_t* p) {  // no byte-masked load in AVX2
    if (m >= kStep) return load(p);
    alignas(32) int8_t lanes[kStep] = {};
    std::memcpy(lanes, p, static_cast<size_t>(m));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  }
  static Acc zero() { return _mm256_setzero_si256(); }
  static Acc madd(Acc acc, Vec x, Vec w) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static Out sum(Acc acc) { return hsum256_epi32(acc); }
};
#endif

#if defined(__AVX512BF16__)
struct Bf16Dot {  // bfloat16 pairs, float32 accumulation (vdpbf16ps); bfloat16 held as uint16
  using X = uint16_t;
  using W = uint16_t;
  using Vec = __m512i;
  using Acc = __m512;
  using Out = float;
  using Mask = __mmask32;
  static constexpr int64_t kStep = 32;
  static constexpr int kSweep = 6;
  static Mask tail_mask(int64_t tail) { return static_cast<Mask>(tail >= kStep ? ~0ull : (1ull << tail) - 1); }
  static Vec load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Vec load(Mask m, const uint16_t* p) { return _mm512_maskz_loadu_epi16(m, p); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  static Out sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#endif

#if defined(__AVX512VNNI__)
struct U8S8Dot {  // unsigned 8-bit x signed 8-bit quadruples, int32 accumulation (vpdpbusd)
  using X = uint8_t;
  using W = int8_t;
  using Vec = __m512i;
  using Acc = __m512i;
  using Out = int32_t;
  using Mask = __mmask64;
  static constexpr int64_t kStep = 64;
  static constexpr int kSweep = 6;
  static Mask tail_mask(int64_t tail) { return static_cast<Mask>(tail >= kStep ? ~0ull : (1ull << tail) - 1); }
  static Vec load(const void* p) { return _mm512_loadu_si512(p); }
  static Vec load(Mask m, const void* p) { return _mm512_maskz_loadu_epi8(m, p); }
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_dpbusd_epi32(acc, x, w); }
  static Out sum(Acc acc) { return _mm512_reduce_add_epi32(acc); }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TANDEM_FEW_ROW_PRODUCTS 1
// out[m, n] = sum_k x[m, k] * w[n, k] for m < M and n in [n0, n1); out has row stride N.
template <typename D, int M>
void dot_rows(const typename D::X* x, int64_t K, const typename D::W* w, int64_t n0, int64_t n1,
              typename D::Out* out, int64_t N) {
  using Mask = typename D::Mask;
  constexpr int64_t S = D::kStep;
  const int64_t tail = K % S;
  const Mask tmask = D::tail_mask(tail);
  const Mask full = D::tail_mask(S);  // every lane (the traits take tail == kStep to mean that)
  int64_t n = n0;
  for (; n + kRowBlock <= n1; n += kRowBlock) {
    typename D::Acc acc[M][kRowBlock];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRowBlock; ++r) acc[m][r] = D::zero();
    const typename D::W* wr = w + n * K;
    int64_t k = 0;
    for (; k + S <= K; k += S) {
      typename D::Vec wv[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) wv[r] = D::load(wr + r * K + k);
      // The next block of rows: hardware prefetch alone leaves this loop well below memory speed.
      for (int r = 0; r < kRowBlock; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(wr + (kRowBlock + r) * K + k), _MM_HINT_T0);
      for (int m = 0; m < M; ++m) {
        const typename D::Vec xv = D::load(x + m * K + k);
        for (int r = 0; r < kRowBlock; ++r) acc[m][r] = D::madd(acc[m][r], xv, wv[r]);
      }
    }
    if (tail) {
      typename D::Vec wv[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) wv[r] = D::load(tmask, wr + r * K + k);
      for (int m = 0; m < M; ++m) {
        const typename D::Vec xv = D::load(tmask, x + m * K + k);
        for (int r = 0; r < kRowBlock; ++r) acc[m][r] = D::madd(acc[m][r], xv, wv[r]);
      }
    }
    static_assert(kRowBlock == 4, "sum4 sums one block of accumulators");
    for (int m = 0; m < M; ++m) sum4(acc[m], out + m * N + n);
  }
  for (; n < n1; ++n) {  // the last few rows, one at a time
    typename D::Acc acc[M];
    for (int m = 0; m < M; ++m) acc[m] = D::zero();
    const typename D::W* wr = w + n * K;
    for (int64_t k = 0; k < K; k += S) {
      const Mask mk = k + S <= K ? full : tmask;
      const typename D::Vec wv = D::load(mk, wr + k);
      for (int m = 0; m < M; ++m) acc[m] = D::madd(acc[m], D::load(mk, x + m * K + k), wv);
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = D::sum(acc[m]);
  }
}

// Activation rows per sweep over the weight (`D::kSweep`): with AVX-512, 6 rows x 4 weight rows =
// 24 accumulators, which with the 4 weight vectors and one activation vector fits the 32 vector
// registers (a speculative verification of 1 + 4 or 1 + 5 tokens is then a single pass over the
// weight); AVX2's 16 registers hold 2 x 4.

// x [M, K] times w [N, K]^T on PyTorch's thread pool, in chunks of kChunk output rows; each chunk's
// results go to store(m, n, value) while they are still on the stack. Activation rows are swept
// D::kSweep at a time, so rows beyond read a chunk's weights a second time, from cache.
template <typename D, typename Store>
void product(const typename D::X* x, int64_t M, int64_t K, const typename D::W* w, int64_t N, Store&& store) {
  for_row_blocks(N, [&](int64_t n0, int64_t n1) {
    typename D::Out acc[kMaxRows * kChunk];
    for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
      const int64_t c1 = std::min(n1, c0 + kChunk), width = c1 - c0;
      for (int64_t m0 = 0; m0 < M; m0 += D::kSweep) {
        // dot_rows indexes outputs from c0: shift the base so chunk row c0 lands at column 0.
        typename D::Out* base = acc + m0 * width - c0;
        const typename D::X* xm = x + m0 * K;
        switch (std::min<int64_t>(D::kSweep, M - m0)) {
          case 1: dot_rows<D, 1>(xm, K, w, c0, c1, base, width); break;
          case 2: dot_rows<D, 2>(xm, K, w, c0, c1, base, width); break;
          case 3: dot_rows<D, std::min(3, D::kSweep)>(xm, K, w, c0, c1, base, width); break;
          case 4: dot_rows<D, std::min(4, D::kSweep)>(xm, K, w, c0, c1, base, width); break;
          case 5: dot_rows<D, std::min(5, D::kSweep)>(xm, K, w, c0, c1, base, width); break;
          default: dot_rows<D, std::min(6, D::kSweep)>(xm, K, w, c0, c1, base, width); break;
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = c0; n < c1; ++n) store(m, n, acc[m * width + (n - c0)]);
    }
  });
}

#if defined(__AVX512F__)
using F32 = F32Dot;
#else
using F32 = F32Dot8;
#endif

// float32 x [M, K] times float32 w [N, K], plus bias.
at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_inputs("tandem gemv_f32", x, w);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "tandem gemv_f32: float32 only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor xc = x.contiguous(), b;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  product<F32>(xc.data_ptr<float>(), M, K, w.data_ptr<float>(), N,
               [&](int64_t m, int64_t n, float v) { op[m * N + n] = bp ? v + bp[n] : v; });
  return out;
}
#endif  // TANDEM_FEW_ROW_PRODUCTS

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512VNNI__)
// float32 x [M, K] times int8 w [N, K] with one float32 scale per output row, plus bias: the weights
// widened in registers (no activation quantization; `gemm_w8a8` where VNNI exists).
at::Tensor gemm_w8_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias) {
  check_inputs("tandem gemm_w8_f32", x, w);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "tandem gemm_w8_f32: x must be float32");
  TORCH_CHECK(w.scalar_type() == at::kChar, "tandem gemm_w8_f32: w must be int8");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == w.size(0),
              "tandem gemm_w8_f32: w_scale must be contiguous float32, one per output row");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor xc = x.contiguous(), b;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const float* sp = w_scale.data_ptr<float>();
  product<W8F32Dot8>(xc.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), N, [&](int64_t m, int64_t n, float v) {
    const float y = v * sp[n];
    op[m * N + n] = bp ? y + bp[n] : y;
  });
  return out;
}
#endif

#if defined(__AVX512BF16__)
// x [M, K] (bfloat16, or float32 rounded to bfloat16) times bfloat16 w [N, K], plus bias; float32
// accumulation, the result in x's dtype.
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_inputs("tandem gemv_bf16", x, w);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "tandem gemv_bf16: w must be bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "tandem gemv_bf16: x must be bfloat16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor xb = x.to(at::kBFloat16).contiguous(), b;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  if (x.scalar_type() == at::kFloat) {
    float* op = out.data_ptr<float>();
    product<Bf16Dot>(xp, M, K, wp, N, [&](int64_t m, int64_t n, float v) { op[m * N + n] = bp ? v + bp[n] : v; });
  } else {
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    product<Bf16Dot>(xp, M, K, wp, N,
                     [&](int64_t m, int64_t n, float v) { op[m * N + n] = float_to_bf16(bp ? v + bp[n] : v); });
  }
  return out;
}
#endif  // __AVX512BF16__

// x float32 [M, K] -> (xq uint8 [M, K] offset by 128, x_scale float32 [M]): the activations of an
// int8 product quantized per row, for a library GEMM that takes one zero point (128) for all rows;
// the caller scales row m of the result by x_scale[m].
std::tuple<at::Tensor, at::Tensor> quantize_rows_u8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "tandem quantize_rows_u8: x must be 2-D float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor xq = at::empty({M, K}, xc.options().dtype(at::kByte));
  at::Tensor scale = at::empty({M}, xc.options());
  const float* xp = xc.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) sp[m] = quantize_row_u8(xp + m * K, K, qp + m * K);
  });
  return {xq, scale};
}

#if defined(__AVX512VNNI__) || (defined(__AVX2__) && defined(__FMA__))
#define TANDEM_W8A8 1
#if defined(__AVX512VNNI__)
using W8A8Dot = U8S8Dot;
constexpr bool kW8A8Offset = true;  // unsigned activations offset by 128, taken out with w_sum
#else
using W8A8Dot = S8S8Dot8;
constexpr bool kW8A8Offset = false;
#endif
// Dynamic int8 activations (one symmetric scale per row, max |x| / 127) times int8 weights with one
// scale per output row: y = x_scale * w_scale * sum(xq * w) + bias, in x's dtype (float32 or
// bfloat16; bfloat16 rows are widened one at a time, not copied whole).
// `vpdpbusd` wants unsigned activations, so they are offset by 128 and the offset is taken back
// out with each weight row's sum (`w_sum`): sum((xq + 128) * w) - 128 * sum(w) = sum(xq * w).
// Without VNNI (AVX2) the activations stay signed (S8S8Dot8) and `w_sum` is not read: the same
// integer sums, so the same results.
at::Tensor gemm_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                     const at::Tensor& w_sum, const std::optional<at::Tensor>& bias) {
  check_inputs("tandem gemm_w8a8", x, w);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tandem gemm_w8a8: x must be float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kChar, "tandem gemm_w8a8: w must be int8");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == w.size(0),
              "tandem gemm_w8a8: w_scale must be contiguous float32, one per output row");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == w.size(0),
              "tandem gemm_w8a8: w_sum must be contiguous int32, one per output row");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xc = x.contiguous();
  RowsF32 rows(xc);
  at::Tensor xu = at::empty({M, K}, x.options().dtype(at::kByte)), b;
  uint8_t* up = xu.data_ptr<uint8_t>();
  float x_scale[kMaxRows];
  for (int64_t m = 0; m < M; ++m) x_scale[m] = quantize_row_u8(rows.row(m), K, up + m * K);
  if constexpr (!kW8A8Offset)  // q + 128 -> q as a signed byte
    for (int64_t i = 0; i < M * K; ++i) up[i] ^= 0x80;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());  // in x's dtype
  if (M == 0) return out;  // an empty float32 output's null data pointer would pass for bfloat16 below
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  uint16_t* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* sp = w_scale.data_ptr<float>();
  const int32_t* sump = w_sum.data_ptr<int32_t>();
  product<W8A8Dot>(reinterpret_cast<const typename W8A8Dot::X*>(up), M, K, w.data_ptr<int8_t>(), N,
                   [&](int64_t m, int64_t n, int32_t dot) {
    const int32_t exact = kW8A8Offset ? dot - 128 * sump[n] : dot;
    float v = static_cast<float>(exact) * x_scale[m] * sp[n];
    if (bp) v += bp[n];
    if (of)
      of[m * N + n] = v;
    else
      ob[m * N + n] = float_to_bf16(v);
  });
  return out;
}
#endif  // TANDEM_W8A8

// ---------------------------------------------------------------------------------------------
// Attention over the paged KV cache for batches of short queries (decodes, speculative
// verifications): writes the step's new K/V into the cache and attends each query to its own
// request's context through the block table, causally, with no gathered copy of the context and no
// padding or mask tensors. Portable C++ (vectorised by the compiler; decodes over a bfloat16 cache
// with AVX512-BF16 intrinsics, attend_decode_bf16); float32 or bfloat16 cache,
// or a quantized one (kv_cache_dtype int8 / fp8, tandem/model/kv_quant.py): rows of head_dim
// one-byte values, zero padding to 4 bytes, and the row's float32 scale.

// An fp8 e4m3 (float8_e4m3fn) value of a quantized cache row, widened through a 256-entry table.
struct Fp8E4M3 {
  uint8_t bits;
};

std::array<float, 256> fp8_e4m3_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b)
    t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
  return t;
}
const std::array<float, 256> kFp8E4M3 = fp8_e4m3_table();

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(Fp8E4M3 v) { return kFp8E4M3[v.bits]; }

// The float32 scale stored `offset` bytes into a quantized cache row.
template <typename C>
inline float row_scale(const C* row, int64_t offset) {
  float s;
  std::memcpy(&s, reinterpret_cast<const uint8_t*>(row) + offset, sizeof s);
  return s;
}

// Query vectors (one query token's head of one KV group) a task attends together: the scores of a
// context position for all of them fill one vector register. Every key and value row is then read
// once for all of a group's heads and a verification's query tokens, and no dot product needs a
// horizontal sum of its own, which is what a per-query loop spends most of its time on.
constexpr int64_t kQueryTile = 16;
// The tile when no request has more query vectors than this (decodes with a GQA group of up to 8):
// half the score work of a 16-wide tile that such a task would mostly fill with padding.
constexpr int64_t kNarrowQueryTile = 8;
// Context positions per score micro-tile: independent accumulators, so the FMAs pipeline.
constexpr int64_t kPosTile = 8;
// Output tile of the probabilities-times-values product: query vectors x head_dim elements.
constexpr int64_t kOutRows = 4;
#if defined(__AVX512F__)
constexpr int64_t kOutCols = 64;
#else
constexpr int64_t kOutCols = 32;  // AVX2: 4 x 32 floats of accumulators fill half the 16 vector registers
#endif

// a[r][0:n] += sum over context positions j of p[j][r] * v_j[d0 : d0 + n], for kOutRows query
// vectors (N: n as a compile-time constant for full tiles, 0 for a tail). Always kOutRows rows, even
// for a partial tile: GCC keeps this shape's accumulators in registers, and fewer rows compiled to
// scalar code.
template <typename E, int64_t N, int64_t QT>
inline void weighted_values(const float* p, int64_t span, const E* const* vrows, int64_t d0, int64_t n,
                            float (&a)[kOutRows][kOutCols]) {
  const int64_t width = N > 0 ? N : n;
  for (int64_t j = 0; j < span; ++j) {
    const E* vr = vrows[j] + d0;
    const float* pj = p + j * QT;
    for (int64_t r = 0; r < kOutRows; ++r) {
      const float w = pj[r];
#pragma omp simd
      for (int64_t dd = 0; dd < width; ++dd) a[r][dd] += w * to_float(vr[dd]);
    }
  }
}

#if defined(__AVX512BF16__)
// One decode's attention for one KV head over a bfloat16 cache with AVX512-BF16 (CPUs without AMX
// run decodes here): the G query heads of its GQA group against `span` context positions. The
// general loop (paged_attention_impl) broadcasts one key element at a time into a query-wide FMA
// (~6 GB/s of cache); here a key row meets each query as bfloat16 pairs (`vdpbf16ps`, four
// positions' sums reduced together), the softmax runs along the positions 16 at a time, and each
// value row, widened to float32 once per pass, is added into kRows queries' outputs (float32
// probabilities, as the general loop keeps them).
// s: G rounded up to kRows rows of ld >= span floats, scratch.
template <int64_t D>
void attend_decode_bf16(const uint16_t* const* qrows, int64_t G, const uint16_t* const* krows,
                        const uint16_t* const* vrows, int64_t span, float scale, float* s, int64_t ld,
                        uint16_t* const* orows) {
  constexpr int64_t V = D / 32;             // bfloat16 vectors a row
  constexpr int64_t kRows = D == 64 ? 4 : 2;  // queries per value pass: kRows * D / 16 accumulators
  // Scores: four key rows at a time against every query (each key row read once). A head's rows lie
  // kv_heads rows apart in the cache, too far apart for the hardware prefetcher: the keys and values
  // kAhead positions on are fetched ahead (the values for the pass after this one, into L2).
  constexpr int64_t kAhead = 32;
  int64_t j = 0;
  for (; j + 4 <= span; j += 4) {
    for (int64_t jj = j + kAhead; jj < std::min(span, j + kAhead + 4); ++jj)
      for (int64_t b = 0; b < D * 2; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(krows[jj]) + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vrows[jj]) + b, _MM_HINT_T1);
      }
    __m512i k[4][V];
    for (int64_t jj = 0; jj < 4; ++jj)
      for (int64_t v = 0; v < V; ++v) k[jj][v] = _mm512_loadu_si512(krows[j + jj] + v * 32);
    for (int64_t c = 0; c < G; ++c) {
      __m512 acc[4];
      for (int64_t jj = 0; jj < 4; ++jj) {
        acc[jj] = _mm512_setzero_ps();
        for (int64_t v = 0; v < V; ++v)
          acc[jj] = _mm512_dpbf16_ps(acc[jj], (__m512bh)k[jj][v], (__m512bh)_mm512_loadu_si512(qrows[c] + v * 32));
      }
      sum4(acc, s + c * ld + j);
    }
  }
  for (; j < span; ++j)
    for (int64_t c = 0; c < G; ++c) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t v = 0; v < V; ++v)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(krows[j] + v * 32),
                               (__m512bh)_mm512_loadu_si512(qrows[c] + v * 32));
      s[c * ld + j] = _mm512_reduce_add_ps(acc);
    }
  for (int64_t c = 0; c < G; ++c) {
    float* sc = s + c * ld;
    // Softmax along the positions; the row's 1 / sum goes into the output.
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (j = 0; j < span; j += 16)
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(std::min<int64_t>(16, span - j)), sc + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale), sv = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < span; j += 16) {
      const __mmask16 k = first_lanes(std::min<int64_t>(16, span - j));
      const __m512 e = tandem_kernels::exp_clamped16(_mm512_min_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, sc + j), sv, m), _mm512_setzero_ps()));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
      _mm512_mask_storeu_ps(sc + j, k, e);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(sum);
    for (j = 0; j < span; j += 16) {
      const __mmask16 k = first_lanes(std::min<int64_t>(16, span - j));
      _mm512_mask_storeu_ps(sc + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + j), _mm512_set1_ps(inv)));
    }
  }
  for (int64_t c = G; c < (G + kRows - 1) / kRows * kRows; ++c) std::fill(s + c * ld, s + c * ld + span, 0.f);
  for (int64_t c0 = 0; c0 < G; c0 += kRows) {
    __m512 acc[kRows][D / 16];
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t e = 0; e < D / 16; ++e) acc[r][e] = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; ++j) {
      __m512 vf[D / 16];
      for (int64_t e = 0; e < D / 16; ++e) vf[e] = load16(vrows[j] + e * 16, first_lanes(16));
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 p = _mm512_set1_ps(s[(c0 + r) * ld + j]);
        for (int64_t e = 0; e < D / 16; ++e) acc[r][e] = _mm512_fmadd_ps(p, vf[e], acc[r][e]);
      }
    }
    for (int64_t r = 0; r < kRows && c0 + r < G; ++r)
      for (int64_t e = 0; e < D / 16; ++e)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orows[c0 + r] + e * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][e]));
  }
}
#endif

// E: the queries' and output's dtype; C: the cache's element (E itself, or int8_t / Fp8E4M3 values
// of quantized rows, kScaled). k and v are the step's new rows as the cache stores them.
template <typename E, typename C, bool kScaled, int64_t QT>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                          const int64_t* slots, const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens,
                          const int64_t* qsl, int64_t B, double scale_d, int64_t window, at::Tensor& out) {
  const int64_t ntok = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int64_t BS = kv_cache.size(2), group = H / KVH;
  // A cache row: RS elements of C (D values, then, when scaled, padding and the scale at byte SO).
  const int64_t RS = kv_cache.size(4), SO = (D + 3) / 4 * 4;
  C* kc = reinterpret_cast<C*>(kv_cache.data_ptr());
  C* vc = kc + kv_cache.stride(0);
  const E* qp = q.data_ptr<E>();
  const C* kp = reinterpret_cast<const C*>(k.data_ptr());
  const C* vp = reinterpret_cast<const C*>(v.data_ptr());
  E* op = out.data_ptr<E>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t t = 0; t < ntok; ++t) {
    for (int64_t g = 0; g < KVH; ++g) {
      std::memcpy(kc + (slots[t] * KVH + g) * RS, kp + t * ks0 + g * ks1, RS * sizeof(C));
      std::memcpy(vc + (slots[t] * KVH + g) * RS, vp + t * vs0 + g * vs1, RS * sizeof(C));
    }
  }
  int64_t max_ctx = 0;
  // Tasks: (request, KV head, tile of its query vectors); task_start[b] is request b's first.
  std::vector<int64_t> task_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    max_ctx = std::max(max_ctx, seq_lens[b]);
    const int64_t tiles = ((qsl[b + 1] - qsl[b]) * group + QT - 1) / QT;
    task_start[b + 1] = task_start[b] + KVH * tiles;
  }
  const float scale = static_cast<float>(scale_d);
  at::parallel_for(0, task_start[B], 1, [&](int64_t task0, int64_t task1) {
    // qt: the tile's queries transposed ([D][QT]); st: scores, then probabilities, of each
    // context position for the tile ([position][QT]).
    std::vector<float> qt(D * QT), st((max_ctx + kPosTile) * QT);
    std::vector<const C*> krows(max_ctx + kPosTile), vrows(max_ctx);
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t b = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
      const int64_t tiles = (task_start[b + 1] - task_start[b]) / KVH, local = task - task_start[b];
      const int64_t g = local / tiles, c0 = (local % tiles) * QT;
      const int64_t seq = seq_lens[b], first = qsl[b], nq = qsl[b + 1] - qsl[b];
      // krows[j], vrows[j]: the key and value rows of context position lo + j (KV head g).
      auto locate = [&](int64_t lo, int64_t span) {
        for (int64_t j = 0; j < span; ++j) {
          const int64_t pos = lo + j, row = tables[b * max_blocks + pos / BS] * BS + pos % BS;
          krows[j] = kc + (row * KVH + g) * RS;
          vrows[j] = vc + (row * KVH + g) * RS;
        }
      };
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<E, at::BFloat16> && std::is_same_v<C, at::BFloat16> && !kScaled) {
        if (nq == 1 && group <= QT && (D == 64 || D == 128)) {  // a decode: its group in one task
          const int64_t lo = window > 0 ? std::max<int64_t>(0, seq - window) : 0, span = seq - lo;
          locate(lo, span);
          const int64_t ld = (span + 15) / 16 * 16;
          if (static_cast<int64_t>(st.size()) < (group + 3) / 4 * 4 * ld) st.resize((group + 3) / 4 * 4 * ld);
          const uint16_t* qrows[QT];
          uint16_t* orows[QT];
          for (int64_t c = 0; c < group; ++c) {
            qrows[c] = reinterpret_cast<const uint16_t*>(qp + first * qs0 + (g * group + c) * qs1);
            orows[c] = reinterpret_cast<uint16_t*>(op + (first * H + g * group + c) * D);
          }
          const auto* const* kr = reinterpret_cast<const uint16_t* const*>(krows.data());
          const auto* const* vr = reinterpret_cast<const uint16_t* const*>(vrows.data());
          if (D == 64)
            attend_decode_bf16<64>(qrows, group, kr, vr, span, scale, st.data(), ld, orows);
          else
            attend_decode_bf16<128>(qrows, group, kr, vr, span, scale, st.data(), ld, orows);
          continue;
        }
      }
#endif
      const int64_t nc = std::min(QT, nq * group - c0);
      // Query vector c is query token i = (c0 + c) / group, head g * group + (c0 + c) % group; it
      // attends context positions lo[c]..hi[c]. Padding vectors repeat the first one.
      int64_t tok[QT], head[QT], lo[QT], hi[QT];
      int64_t jlo = seq, jhi = 0;
      for (int64_t c = 0; c < QT; ++c) {
        const int64_t i = (c0 + std::min(c, nc - 1)) / group;
        tok[c] = first + i;
        head[c] = g * group + (c0 + std::min(c, nc - 1)) % group;
        hi[c] = seq - nq + i;
        lo[c] = window > 0 ? std::max<int64_t>(0, hi[c] - window + 1) : 0;
        jlo = std::min(jlo, lo[c]);
        jhi = std::max(jhi, hi[c]);
        const E* qr = qp + tok[c] * qs0 + head[c] * qs1;
        for (int64_t d = 0; d < D; ++d) qt[d * QT + c] = c < nc ? to_float(qr[d]) * scale : 0.f;
      }
      const int64_t span = jhi - jlo + 1;
      locate(jlo, span);
      for (int64_t j = span; j < span + kPosTile; ++j) krows[j] = krows[0];  // tail of the last tile
      // Scores: for kPosTile positions at a time, accumulate key element d times query column d.
      for (int64_t j0 = 0; j0 < span; j0 += kPosTile) {
        float acc[kPosTile][QT] = {};
        const C* const* kr = krows.data() + j0;
        for (int64_t d = 0; d < D; ++d) {
          const float* qd = qt.data() + d * QT;
          for (int64_t jj = 0; jj < kPosTile; ++jj) {
            const float kv = to_float(kr[jj][d]);
#pragma omp simd
            for (int64_t c = 0; c < QT; ++c) acc[jj][c] += kv * qd[c];
          }
        }
        if constexpr (kScaled) {  // a key row is its values times its scale: scale the dot products
          for (int64_t jj = 0; jj < kPosTile; ++jj) {
            const float ks = row_scale(kr[jj], SO);
#pragma omp simd
            for (int64_t c = 0; c < QT; ++c) acc[jj][c] *= ks;
          }
        }
        std::memcpy(st.data() + j0 * QT, acc, sizeof acc);
      }
      // Softmax over each query vector's own causal (and windowed) range, across the vectors at once.
      float mx[QT], sum[QT] = {};
      std::fill(mx, mx + QT, -INFINITY);
      for (int64_t j = 0; j < span; ++j) {
        const float* s = st.data() + j * QT;
        const int64_t pos = jlo + j;
#pragma omp simd
        for (int64_t c = 0; c < QT; ++c)
          mx[c] = (pos >= lo[c] && pos <= hi[c]) ? std::max(mx[c], s[c]) : mx[c];
      }
      for (int64_t j = 0; j < span; ++j) {
        float* s = st.data() + j * QT;
        const int64_t pos = jlo + j;
#pragma omp simd
        for (int64_t c = 0; c < QT; ++c) {
          const float e = tandem_kernels::exp_clamped(std::min(s[c] - mx[c], 0.f));
          s[c] = (pos >= lo[c] && pos <= hi[c]) ? e : 0.f;
          sum[c] += s[c];
        }
      }
      if constexpr (kScaled) {  // likewise a value row: fold its scale into the weights (not the sums)
        for (int64_t j = 0; j < span; ++j) {
          float* s = st.data() + j * QT;
          const float vs = row_scale(vrows[j], SO);
#pragma omp simd
          for (int64_t c = 0; c < QT; ++c) s[c] *= vs;
        }
      }
      // Values: kOutRows query vectors x kOutCols head elements per pass.
      float inv[QT];
      E* orows[QT];
      for (int64_t c = 0; c < nc; ++c) {
        inv[c] = 1.f / sum[c];
        orows[c] = op + (tok[c] * H + head[c]) * D;
      }
      for (int64_t r0 = 0; r0 < nc; r0 += kOutRows) {
        for (int64_t d0 = 0; d0 < D; d0 += kOutCols) {
          const int64_t n = std::min(kOutCols, D - d0);
          const float* p = st.data() + r0;
          float a[kOutRows][kOutCols] = {};
          if (n == kOutCols) {
            weighted_values<C, kOutCols, QT>(p, span, vrows.data(), d0, n, a);
          } else {
            weighted_values<C, 0, QT>(p, span, vrows.data(), d0, n, a);
          }
          for (int64_t r = 0; r < kOutRows && r0 + r < nc; ++r)
            for (int64_t dd = 0; dd < n; ++dd) orows[r0 + r][d0 + dd] = static_cast<E>(a[r][dd] * inv[r0 + r]);
        }
      }
    }
  });
}

// The kernel with the query tile this batch needs: the narrow one when every request's query
// vectors (query tokens x GQA group) fit in it.
template <typename E, typename C, bool kScaled>
void paged_attention_tiled(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                           const int64_t* slots, const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens,
                           const int64_t* qsl, int64_t B, double scale, int64_t window, at::Tensor& out) {
  const int64_t group = q.size(1) / k.size(1);
  int64_t widest = 0;
  for (int64_t b = 0; b < B; ++b) widest = std::max(widest, (qsl[b + 1] - qsl[b]) * group);
  if (widest <= kNarrowQueryTile) {
    paged_attention_impl<E, C, kScaled, kNarrowQueryTile>(q, k, v, kv_cache, slots, tables, max_blocks, seq_lens,
                                                          qsl, B, scale, window, out);
  } else {
    paged_attention_impl<E, C, kScaled, kQueryTile>(q, k, v, kv_cache, slots, tables, max_blocks, seq_lens, qsl,
                                                    B, scale, window, out);
  }
}

// A quantized cache's kernel for the queries' dtype.
template <typename C, bool kScaled>
void dispatch_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& query_start_loc, double scale, int64_t window, at::Tensor& out) {
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), B = seq_lens.numel();
  if (q.scalar_type() == at::kFloat) {
    paged_attention_tiled<float, C, kScaled>(q, k, v, kv_cache, slots, tables, max_blocks, sl, qsl, B, scale, window,
                                            out);
  } else {
    paged_attention_tiled<at::BFloat16, C, kScaled>(q, k, v, kv_cache, slots, tables, max_blocks, sl, qsl, B, scale,
                                                   window, out);
  }
}

// q [T, H, D], k and v [T, KVH, D] (rows may be strided views), kv_cache [2, blocks, block_size,
// KVH, D]; per request b: tokens query_start_loc[b]..query_start_loc[b+1] are the last ones of its
// seq_lens[b]-token context. Returns the attention output [T, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                           int64_t sliding_window) {
  const char* op = "tandem paged_attention";
  at::Tensor out = check_paged(op, q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && q.size(2) == kv_cache.size(4), op,
              ": q and the cache must share a dtype and head_dim");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), B = seq_lens.numel();
  if (q.scalar_type() == at::kFloat) {
    paged_attention_tiled<float, float, false>(q, k, v, kv_cache, slots, tables, max_blocks, sl, qsl, B, scale,
                                              sliding_window, out);
  } else {
    paged_attention_tiled<at::BFloat16, at::BFloat16, false>(q, k, v, kv_cache, slots, tables, max_blocks, sl, qsl,
                                                            B, scale, sliding_window, out);
  }
  return out;
}

// The same over a quantized cache (uint8 rows: head_dim int8 or fp8 e4m3 values, padding to 4
// bytes, a float32 scale); k_rows and v_rows are the step's new K/V already quantized to such rows.
at::Tensor paged_attention_quantized(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                                     at::Tensor kv_cache, const at::Tensor& slot_mapping,
                                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                                     bool fp8) {
  const char* op = "tandem paged_attention_quantized";
  at::Tensor out =
      check_paged(op, q, k_rows, v_rows, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(kv_cache.scalar_type() == at::kByte, op, ": the cache must be uint8 rows");
  TORCH_CHECK(kv_cache.size(4) == (q.size(2) + 3) / 4 * 4 + 4, op,
              ": a cache row must be head_dim bytes, padding to 4 and a float32 scale");
  if (fp8) {
    dispatch_paged<Fp8E4M3, true>(q, k_rows, v_rows, kv_cache, slot_mapping, block_tables, seq_lens,
                                  query_start_loc, scale, sliding_window, out);
  } else {
    dispatch_paged<int8_t, true>(q, k_rows, v_rows, kv_cache, slot_mapping, block_tables, seq_lens,
                                 query_start_loc, scale, sliding_window, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
#if defined(TANDEM_FEW_ROW_PRODUCTS)
  m.def("gemv_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512VNNI__)
  m.def("gemm_w8_f32(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor");
#endif
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window) -> Tensor");
  m.def(
      "paged_attention_quantized(Tensor q, Tensor k_rows, Tensor v_rows, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, bool fp8) "
      "-> Tensor");
#if defined(__AVX512BF16__)
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
#endif
#if defined(TANDEM_W8A8)
  m.def("gemm_w8a8(Tensor x, Tensor w, Tensor w_scale, Tensor w_sum, Tensor? bias) -> Tensor");
#endif
  m.def("quantize_rows_u8(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
#if defined(TANDEM_FEW_ROW_PRODUCTS)
  m.impl("gemv_f32", &gemv_f32);
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512VNNI__)
  m.impl("gemm_w8_f32", &gemm_w8_f32);
#endif
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_quantized", &paged_attention_quantized);
#if defined(__AVX512BF16__)
  m.impl("gemv_bf16", &gemv_bf16);
#endif
#if defined(TANDEM_W8A8)
  m.impl("gemm_w8a8", &gemm_w8a8);
#endif
  m.impl("quantize_rows_u8", &quantize_rows_u8);
}
