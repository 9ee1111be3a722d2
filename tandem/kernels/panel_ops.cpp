// Products over a weight laid out in column panels, for CPUs with AVX-512 and no AMX (AMD Zen 4 /
// Zen 5, Cooper Lake, Ice Lake): bfloat16 weights (AVX512-BF16 `vdpbf16ps`), int8 and 4-bit weights
// against int8 activations (AVX512-VNNI `vpdpbusd`), each for every row count.
//
// The layout (tandem/model/panels.py packs it): the output columns in panels of 16, each panel
// [K / D, 16, D] for D inputs a 32-bit lane (bfloat16: 2, int8: 4): for every group of D inputs,
// the 16 columns' D weights side by side, as the instruction multiplies them against one broadcast
// group of an activation row. A panel's 16 sums then build up in the 16 lanes of one register, with
// no horizontal sum at the end, and an activation group read once serves every panel in flight:
// each multiply reads 4 bytes of activations where a row-dot form (`gemv_bf16`, `gemm_w8a8`) reads
// 64. With several activation rows that form reads its activations from L2 once K x rows outgrows
// L1 and stalls on them; here a weight vector meets every row while it is in a register, so up to
// 16 rows take one pass over the weight, the multiplies running beside the stream. More rows take
// each chunk of panels again per 16 rows, from L2: compute-bound there, where int8's `vpdpbusd`
// (64 products an instruction) takes 0.64-0.77x the time of oneDNN's int8 GEMM at 32-512 rows on
// the Sapphire Rapids VM with AMX masked, and bfloat16's `vdpbf16ps` (32) 0.93-0.99x oneDNN's
// AVX512-BF16 GEMM on the AMD EPYC kind (0.42 TFLOP/s at 512 rows, 90% of the instruction's peak).

#include <torch/library.h>

#include <memory>
#include <optional>

#include "exp_approx.h"
#include "kernel_util.h"

namespace {

#if defined(__AVX512BF16__) || defined(__AVX512VNNI__)
constexpr int64_t kPanel = 16;  // output columns per panel: one vector of 32-bit sums
constexpr int kMaxRows = 16;
// Lanes (64-byte steps) ahead that each panel stream is prefetched: hardware prefetch alone
// leaves several interleaved streams below memory speed.
constexpr int64_t kAhead = 16;

// Panels multiplied together for M activation rows: M x R accumulators and R weight vectors in at
// most 27 of the 32 vector registers, at most 8 streams. A budget of 30 (all but the broadcast and
// one spare) was no faster at any row count on the Sapphire Rapids VM with AMX masked and slower at
// 4-16 rows in most runs; 24 no faster.
constexpr int panels_per_block(int m) { return std::min(8, 27 / (m + 1)); }

#if defined(__AVX512BF16__)
struct Bf16Pairs {  // two bfloat16 inputs a lane, float32 sums
  using Acc = __m512;
  using Out = float;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc a, __m512i x, __m512i w) { return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)w); }
  static void store(float* p, Acc a) { _mm512_storeu_ps(p, a); }
};
#endif

#if defined(__AVX512VNNI__)
struct U8S8Quads {  // four unsigned-byte activations x four signed-byte weights a lane, int32 sums
  using Acc = __m512i;
  using Out = int32_t;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc madd(Acc a, __m512i x, __m512i w) { return _mm512_dpbusd_epi32(a, x, w); }
  static void store(int32_t* p, Acc a) { _mm512_storeu_si512(p, a); }
};
#endif

// out[m * ld + r * 16 + c] = sum over lanes j of x[m] lane j times panel r's lane j, column c, for
// R panels from `w` (J lanes of 64 bytes a panel).
template <typename T, int M, int R>
void panel_block(const uint32_t* x, int64_t J, const uint8_t* w, typename T::Out* out, int64_t ld) {
  typename T::Acc acc[M][R];
  TANDEM_UNROLL for (int m = 0; m < M; ++m)
    TANDEM_UNROLL for (int r = 0; r < R; ++r) acc[m][r] = T::zero();
  const int64_t stride = J * 64;  // bytes per panel
  for (int64_t j = 0; j < J; ++j) {
    __m512i wv[R];
    TANDEM_UNROLL for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w + r * stride + j * 64);
    TANDEM_UNROLL for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + (j + kAhead) * 64), _MM_HINT_T0);
    TANDEM_UNROLL for (int m = 0; m < M; ++m) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[m * J + j]));
      TANDEM_UNROLL for (int r = 0; r < R; ++r) acc[m][r] = T::madd(acc[m][r], xb, wv[r]);
    }
  }
  TANDEM_UNROLL for (int m = 0; m < M; ++m)
    TANDEM_UNROLL for (int r = 0; r < R; ++r) T::store(out + m * ld + r * kPanel, acc[m][r]);
}

// Rows one pass over a block of panels takes: more are split into two passes over the same block
// (from L2 the second time). On the Sapphire Rapids VM with AMX masked, one pass of 15-16 rows (one
// panel at a time) took 102-107 ms over the 415M's layers against 69-73 for 13-14 in one pass; two
// passes of 15-16 rows took 73-78.
constexpr int kPassRows = 12;

// Panels [p0, p1) for M rows: blocks of panels_per_block(M), then the rest one panel at a time.
template <typename T, int M>
void panel_range(const uint32_t* x, int64_t J, const uint8_t* w, int64_t p0, int64_t p1, typename T::Out* out,
                 int64_t ld) {
  constexpr int M1 = M <= kPassRows ? M : (M + 1) / 2, M2 = M - M1;
  constexpr int R = panels_per_block(M1);
  const int64_t stride = J * 64;
  auto block = [&]<int B>(int64_t p) {
    panel_block<T, M1, B>(x, J, w + p * stride, out + (p - p0) * kPanel, ld);
    if constexpr (M2 > 0) panel_block<T, M2, B>(x + M1 * J, J, w + p * stride, out + M1 * ld + (p - p0) * kPanel, ld);
  };
  int64_t p = p0;
  for (; p + R <= p1; p += R) block.template operator()<R>(p);
  for (; p < p1; ++p) block.template operator()<1>(p);
}

template <typename T, int M = 1>
void panel_rows(int m, const uint32_t* x, int64_t J, const uint8_t* w, int64_t p0, int64_t p1,
                typename T::Out* out, int64_t ld) {
  if constexpr (M < kMaxRows) {
    if (m > M) return panel_rows<T, M + 1>(m, x, J, w, p0, p1, out, ld);
  }
  panel_range<T, M>(x, J, w, p0, p1, out, ld);
}

// The panels' products on PyTorch's thread pool, in chunks of panels whose sums stay on the stack:
// rows(m0, m, c0, c1, acc, ld) writes rows m0 .. m0 + m - 1 (m <= kMaxRows) of panels [c0, c1) to
// acc (row i at acc + i * ld, panel c at (c - c0) * 16); each panel's sums for row m then go to
// store(m, n0, mask, sums) (columns n0 .. n0 + 15, `mask` the ones below N). More than kMaxRows
// rows take the chunk's panels again per kMaxRows, from L2. Threads take whole units of kUnit
// panels (P a multiple of it), so a unit's panels share a chunk and sit side by side in `acc`;
// kFlush runs them with denormals flushed (for an epilogue's exp).
template <typename Out, int64_t kUnit = 1, bool kFlush = false, typename Rows, typename Store>
void panel_product(int64_t M, int64_t P, int64_t N, Rows&& rows, Store&& store) {
  constexpr int64_t kChunkPanels = 8;
  static_assert(kChunkPanels % kUnit == 0, "a chunk holds whole units");
  at::parallel_for(0, P / kUnit, std::max<int64_t>(1, 2 / kUnit), [&](int64_t u0, int64_t u1) {
    std::optional<tandem_kernels::FlushDenormals> flush;
    if constexpr (kFlush) flush.emplace();
    const int64_t q0 = u0 * kUnit, q1 = u1 * kUnit;
    alignas(64) Out acc[kMaxRows * kChunkPanels * kPanel];
    for (int64_t c0 = q0; c0 < q1; c0 += kChunkPanels) {
      const int64_t c1 = std::min(q1, c0 + kChunkPanels), ld = (c1 - c0) * kPanel;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t m = std::min<int64_t>(kMaxRows, M - m0);
        rows(m0, m, c0, c1, acc, ld);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t n0 = c * kPanel, len = std::min(kPanel, N - n0);
            store(m0 + i, n0, first_lanes(len), acc + i * ld + (c - c0) * kPanel);
          }
        }
      }
    }
  });
}

// x [M, J] 32-bit lanes (M <= kMaxRows) times the panels [P, J, 16, D] with T's multiply.
template <typename T, typename Store>
void lane_product(const uint32_t* x, int64_t M, int64_t J, const uint8_t* w, int64_t P, int64_t N, Store&& store) {
  panel_product<typename T::Out>(
      M, P, N,
      [&](int64_t m0, int64_t m, int64_t c0, int64_t c1, typename T::Out* acc, int64_t ld) {
        panel_rows<T>(static_cast<int>(m), x + m0 * J, J, w, c0, c1, acc, ld);
      },
      store);
}

// `depth` bytes a lane of `dtype` elements holding `inputs` inputs; at most `max_rows` rows.
void check_panels(const char* op, const at::Tensor& x, const at::Tensor& panels, int64_t N, int64_t depth,
                  at::ScalarType dtype, int64_t inputs, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, ": x must be bfloat16 or float32");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kPanel && panels.size(3) == depth && panels.is_contiguous() &&
                  panels.scalar_type() == dtype,
              op, ": panels must be contiguous ", c10::toString(dtype), " [P, K/", inputs, ", 16, ", depth, "]");
  const int64_t P = panels.size(0);
  TORCH_CHECK(x.size(1) == inputs * panels.size(1), op, ": x has ", x.size(1), " columns, the panels ",
              inputs * panels.size(1));
  TORCH_CHECK(N > 16 * (P - 1) && N <= 16 * P, op, ": ", N, " columns do not fill ", P, " panels");
  TORCH_CHECK(x.size(0) <= max_rows, op, ": at most ", max_rows, " rows, got ", x.size(0));
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), op, ": CPU tensors only");
}

// 16 float32 values as bfloat16, rounded to nearest even as PyTorch rounds (a NaN stays a NaN);
// the int8 kernel also builds on CPUs with VNNI and no AVX512-BF16 (Ice Lake, Cascade Lake).
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i r = round_bf16_lanes(v);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
#endif
}

// 16 bfloat16 values (to_bf16's result) back in float32.
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Stores 16 float32 values (the lanes in `mask`) as float32 or bfloat16.
inline void store16(float* of, uint16_t* ob, int64_t i, __mmask16 mask, __m512 v) {
  if (of)
    _mm512_mask_storeu_ps(of + i, mask, v);
  else
    _mm256_mask_storeu_epi16(ob + i, mask, to_bf16(v));
}

// A gate/up product's intermediate width: whole panels of gate and of up.
void check_gate_up_panels(const char* op, int64_t intermediate) {
  TORCH_CHECK(intermediate > 0 && intermediate % kPanel == 0, op,
              ": intermediate must be a positive multiple of 16 (whole panels of gate and up)");
}

// silu(gate) * up [M, I] in x's dtype from T's product of the activation lanes `xp` with gate/up
// panels interleaved one gate panel, then its up panel (threads take whole pairs, so the epilogue
// finds both in its chunk). value(m, n0, sums) is row m's 16 columns from n0 as the plain product
// computes them before rounding; each half is rounded to x's dtype as that product stores it, and
// silu to it as silu_mul does, so the bits are those of the two passes.
template <typename T, typename Value>
at::Tensor silu_mul_product(const at::Tensor& x, const uint32_t* xp, const at::Tensor& panels, int64_t intermediate,
                            Value&& value) {
  const int64_t M = x.size(0), J = panels.size(1);
  at::Tensor out = at::empty({M, intermediate}, x.options());
  if (M == 0) return out;
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto* wp = reinterpret_cast<const uint8_t*>(panels.data_ptr());
  auto stored = [&](__m512 v) { return ob ? widen_bf16(to_bf16(v)) : v; };
  panel_product<typename T::Out, 2, true>(
      M, panels.size(0), 2 * intermediate,
      [&](int64_t m0, int64_t m, int64_t c0, int64_t c1, typename T::Out* acc, int64_t ld) {
        panel_rows<T>(static_cast<int>(m), xp + m0 * J, J, wp, c0, c1, acc, ld);
      },
      [&](int64_t m, int64_t n0, __mmask16, const typename T::Out* sums) {
        if (n0 % (2 * kPanel)) return;  // an up panel: its gate panel's call took it
        const __m512 s = stored(tandem_kernels::silu16(stored(value(m, n0, sums))));
        store16(of, ob, m * intermediate + n0 / 2, 0xFFFF,
                _mm512_mul_ps(s, stored(value(m, n0 + kPanel, sums + kPanel))));
      });
  return out;
}
#endif

#if defined(__AVX512BF16__)
// x [M, K] (bfloat16, or float32 rounded to bfloat16) times the bfloat16 weight in panels
// [P, K/2, 16, 2] (N output columns, N <= 16 P), plus bias; float32 accumulation, the result
// [M, N] in x's dtype.
at::Tensor gemm_bf16_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                            const std::optional<at::Tensor>& bias) {
  check_panels("tandem gemm_bf16_panels", x, panels, N, 2, at::kBFloat16, 2, x.size(0));  // any number of rows
  const int64_t M = x.size(0);
  at::Tensor xb = x.to(at::kBFloat16).contiguous(), b;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  lane_product<Bf16Pairs>(reinterpret_cast<const uint32_t*>(xb.data_ptr()), M, panels.size(1),
                           reinterpret_cast<const uint8_t*>(panels.data_ptr()), panels.size(0), N,
                           [&](int64_t m, int64_t n0, __mmask16 mask, const float* sums) {
    __m512 v = _mm512_loadu_ps(sums);
    if (bp) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + n0));
    store16(of, ob, m * N + n0, mask, v);
  });
  return out;
}

// silu(x . gate^T) * (x . up^T) [M, I] in one pass, for a gate/up weight whose 2I rows were
// interleaved 16 at a time before packing (gate 0-15, up 0-15, gate 16-31, ...:
// tandem/model/gate_up.py), so that panel 2p holds gate columns 16p .. 16p + 15 and panel 2p + 1 the
// same up columns: the epilogue writes the activation instead of the [M, 2I] product, with the
// roundings of gemm_bf16_panels then silu_mul (a bfloat16 x: gate and up to bfloat16, silu to
// bfloat16, the product to bfloat16), so the same bits.
at::Tensor gemm_bf16_panels_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t intermediate) {
  const char* op = "tandem gemm_bf16_panels_silu_mul";
  check_gate_up_panels(op, intermediate);
  check_panels(op, x, panels, 2 * intermediate, 2, at::kBFloat16, 2, x.size(0));  // any number of rows
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  return silu_mul_product<Bf16Pairs>(x, reinterpret_cast<const uint32_t*>(xb.data_ptr()), panels, intermediate,
                                     [](int64_t, int64_t, const float* sums) { return _mm512_loadu_ps(sums); });
}
#endif  // __AVX512BF16__

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// What an int8 panel product reads besides the weight: x's rows quantized (one symmetric scale per
// row, as gemm_w8a8 quantizes them; offset by 128) and the per-column weight scales, sums and bias.
struct W8A8PanelInputs {
  at::Tensor rows, row_scales, bias_holder;
  const float* row_scale = nullptr;
  const float* bias = nullptr;
  const float* w_scale = nullptr;
  const int32_t* w_sum = nullptr;
  const uint32_t* lanes() const { return reinterpret_cast<const uint32_t*>(rows.data_ptr()); }
  // Row m's 16 columns from n0 (the lanes in `mask`) in float32, before rounding to x's dtype:
  // the sums less 128 x w_sum, times the row's scale, times the columns' scales, plus bias.
  __m512 columns(int64_t m, int64_t n0, __mmask16 mask, const int32_t* sums) const {
    const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, w_sum + n0), 7);  // 128 * w_sum
    const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums), offset);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(row_scale[m]));
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, w_scale + n0));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0));
    return v;
  }
};

// Checks an int8 panel product's inputs (N output columns) and quantizes x's rows.
W8A8PanelInputs prepare_w8a8_panels(const char* op, const at::Tensor& x, const at::Tensor& panels, int64_t N,
                                    const at::Tensor& w_scale, const at::Tensor& w_sum,
                                    const std::optional<at::Tensor>& bias) {
  check_panels(op, x, panels, N, 4, at::kChar, 4, x.size(0));  // any number of rows
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == N, op,
              ": w_scale must be contiguous float32, one per output column");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == N, op,
              ": w_sum must be contiguous int32, one per output column");
  const int64_t M = x.size(0), K = x.size(1);
  W8A8PanelInputs in;
  in.rows = at::empty({M, K}, x.options().dtype(at::kByte));
  in.row_scales = at::empty({M}, x.options().dtype(at::kFloat));
  in.row_scale = in.row_scales.data_ptr<float>();
  if (M > 0) quantize_rows_u8_16(x.contiguous(), in.rows.data_ptr<uint8_t>(), K, in.row_scales.data_ptr<float>());
  in.bias = bias_ptr(bias, N, in.bias_holder);
  in.w_scale = w_scale.data_ptr<float>();
  in.w_sum = w_sum.data_ptr<int32_t>();
  return in;
}

// Dynamic int8 activations times the int8 weight in panels [P, K/4, 16, 4] with one scale and one
// sum per output column (`w_sum` takes the activations' +128 offset back out), plus bias; the
// result [M, N] in x's dtype.
at::Tensor gemm_w8a8_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N, const at::Tensor& w_scale,
                            const at::Tensor& w_sum, const std::optional<at::Tensor>& bias) {
  const W8A8PanelInputs in = prepare_w8a8_panels("tandem gemm_w8a8_panels", x, panels, N, w_scale, w_sum, bias);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  lane_product<U8S8Quads>(in.lanes(), M, panels.size(1), reinterpret_cast<const uint8_t*>(panels.data_ptr()),
                           panels.size(0), N, [&](int64_t m, int64_t n0, __mmask16 mask, const int32_t* sums) {
                             store16(of, ob, m * N + n0, mask, in.columns(m, n0, mask, sums));
                           });
  return out;
}

// gemm_w8a8_panels over a gate/up weight whose panels were interleaved as for
// gemm_bf16_panels_silu_mul (w_scale, w_sum and bias in that interleaved column order):
// silu(gate) * up [M, I] in x's dtype, with the roundings of gemm_w8a8_panels then silu_mul.
at::Tensor gemm_w8a8_panels_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t intermediate,
                                     const at::Tensor& w_scale, const at::Tensor& w_sum,
                                     const std::optional<at::Tensor>& bias) {
  const char* op = "tandem gemm_w8a8_panels_silu_mul";
  check_gate_up_panels(op, intermediate);
  const W8A8PanelInputs in = prepare_w8a8_panels(op, x, panels, 2 * intermediate, w_scale, w_sum, bias);
  return silu_mul_product<U8S8Quads>(
      x, in.lanes(), panels, intermediate,
      [&](int64_t m, int64_t n0, const int32_t* sums) { return in.columns(m, n0, 0xFFFF, sums); });
}
#endif  // __AVX512VNNI__ && __AVX512BW__

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 4-bit weights in panels [P, K/8, 16, 4] bytes: a lane is one column's 8 inputs 8j .. 8j + 7,
// byte b holding input 8j + b in its low nibble and 8j + 4 + b in its high one, unsigned 0..15,
// the weight (q - zero) * scale of its group. An AND and a shift + AND give two lanes of four
// unsigned bytes, and `vpdpbusd` multiplies them by the broadcast int8 activations (as
// gemm_int4 quantizes them: one scale per 32 inputs). A block's 32 inputs sum in int32, then
// convert and scale by the block's activation scale times the group's 16 column scales (one
// vector of the scales panels [P, G, 16]). A symmetric weight's zero point (8) comes out in
// integers, each block's sums starting at -8 x its int8 activations' sum; an asymmetric one's
// per group, zs (= scale x zero, [P, G, 16]) times the group's activation sum.
struct Int4PanelRows {  // activation rows, quantized: row m's data at m x (K, K/32, G)
  const int8_t* q;      // [M, K]
  const float* s;       // [M, K/32]: each block's scale
  const int32_t* zc;    // [M, K/32]: -8 x the block's int8 sum
  const float* xg;      // [M, G]: each group's sum of the activations as quantized
  Int4PanelRows rows_from(int64_t m, int64_t K, int64_t G) const {
    return {q + m * K, s + m * (K / 32), zc + m * (K / 32), xg + m * G};
  }
};

// M rows times R panels: M x R int32 block sums and as many float totals, each row's two
// broadcasts and a panel's two nibble vectors within 30 registers; R divides a chunk's 8 panels
// (R = 5 ran a chunk as 5 + 1 + 1 + 1 panels).
constexpr int int4_panels_per_block(int m) {
  for (int r : {8, 4, 2})
    if (2 * m * r + 2 * m + 3 <= 30) return r;
  return 1;
}
// Lanes ahead each 4-bit panel stream is prefetched: the nibbles take more instructions a byte
// than the other weights' lanes, so a lane goes by sooner. At 8 rows 32 took 15.6-15.8 ms a pass
// over the 415M's layers against 16.6-17.6 with 16 (Sapphire Rapids VM, AMX masked).
constexpr int64_t kInt4Ahead = 32;
// Rows one pass over a block of panels takes; more are split into two passes.
constexpr int kInt4PassRows = 8;

// A group's 16 column scales (or zero terms), held as float32 or as float16 (its bits).
inline __m512 load_group(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_group(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int M, int R, bool SYM, typename S>
void int4_panel_block(const Int4PanelRows& a, int64_t K, int64_t gs, const uint8_t* w, const S* ws,
                      const S* wz, float* out, int64_t ld) {
  const int64_t B = K / 32, G = K / gs, bpg = gs / 32, stride = K / 8 * 64, sstride = G * kPanel;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 tot[M][R];
  TANDEM_UNROLL for (int m = 0; m < M; ++m)
    TANDEM_UNROLL for (int r = 0; r < R; ++r) tot[m][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      __m512i ia[M][R];
      TANDEM_UNROLL for (int m = 0; m < M; ++m) {
        const __m512i start = SYM ? _mm512_set1_epi32(a.zc[m * B + b]) : _mm512_setzero_si512();
        TANDEM_UNROLL for (int r = 0; r < R; ++r) ia[m][r] = start;
      }
      for (int64_t j = b * 4; j < b * 4 + 4; ++j) {
        __m512i b0[M], b1[M];
        TANDEM_UNROLL for (int m = 0; m < M; ++m) {
          int32_t x0, x1;
          std::memcpy(&x0, a.q + m * K + j * 8, 4);
          std::memcpy(&x1, a.q + m * K + j * 8 + 4, 4);
          b0[m] = _mm512_set1_epi32(x0);
          b1[m] = _mm512_set1_epi32(x1);
        }
        // Near a panel's end, stream r prefetches the start of the next block's panel r: panels of
        // 4-bit weights are short (7 KB for K = 896), so a block starting cold costs much.
        const int64_t ahead = (j + kInt4Ahead) * 64 + (j + kInt4Ahead >= K / 8 ? (R - 1) * stride : 0);
        TANDEM_UNROLL for (int r = 0; r < R; ++r) {
          const __m512i v = _mm512_loadu_si512(w + r * stride + j * 64);
          _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + ahead), _MM_HINT_T0);
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          TANDEM_UNROLL for (int m = 0; m < M; ++m) {
            ia[m][r] = _mm512_dpbusd_epi32(ia[m][r], lo, b0[m]);
            ia[m][r] = _mm512_dpbusd_epi32(ia[m][r], hi, b1[m]);
          }
        }
      }
      TANDEM_UNROLL for (int r = 0; r < R; ++r) {
        const __m512 wsv = load_group(ws + r * sstride + g * kPanel);
        TANDEM_UNROLL for (int m = 0; m < M; ++m) {
          const __m512 scale = _mm512_mul_ps(wsv, _mm512_set1_ps(a.s[m * B + b]));
          tot[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][r]), scale, tot[m][r]);
        }
      }
    }
    if constexpr (!SYM) {
      TANDEM_UNROLL for (int r = 0; r < R; ++r) {
        const __m512 zv = load_group(wz + r * sstride + g * kPanel);
        TANDEM_UNROLL for (int m = 0; m < M; ++m) tot[m][r] = _mm512_fnmadd_ps(zv, _mm512_set1_ps(a.xg[m * G + g]), tot[m][r]);
      }
    }
  }
  TANDEM_UNROLL for (int m = 0; m < M; ++m)
    TANDEM_UNROLL for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + m * ld + r * kPanel, tot[m][r]);
}

// Panels [p0, p1) for M rows, as panel_range does for the other weights.
template <int M, bool SYM, typename S>
void int4_panel_range(const Int4PanelRows& a, int64_t K, int64_t gs, const uint8_t* w, const S* ws,
                      const S* wz, int64_t p0, int64_t p1, float* out, int64_t ld) {
  constexpr int M1 = M <= kInt4PassRows ? M : (M + 1) / 2, M2 = M - M1;
  constexpr int R = int4_panels_per_block(M1);
  const int64_t stride = K / 8 * 64, sstride = K / gs * kPanel;
  const Int4PanelRows second = a.rows_from(M1, K, K / gs);
  auto block = [&]<int Q>(int64_t p) {
    const S* z = SYM ? nullptr : wz + p * sstride;
    int4_panel_block<M1, Q, SYM>(a, K, gs, w + p * stride, ws + p * sstride, z, out + (p - p0) * kPanel, ld);
    if constexpr (M2 > 0)
      int4_panel_block<M2, Q, SYM>(second, K, gs, w + p * stride, ws + p * sstride, z,
                                   out + M1 * ld + (p - p0) * kPanel, ld);
  };
  int64_t p = p0;
  for (; p + R <= p1; p += R) block.template operator()<R>(p);
  for (; p < p1; ++p) block.template operator()<1>(p);
}

template <bool SYM, typename S, int M = 1>
void int4_panel_rows(int m, const Int4PanelRows& a, int64_t K, int64_t gs, const uint8_t* w, const S* ws,
                     const S* wz, int64_t p0, int64_t p1, float* out, int64_t ld) {
  if constexpr (M < kMaxRows) {
    if (m > M) return int4_panel_rows<SYM, S, M + 1>(m, a, K, gs, w, ws, wz, p0, p1, out, ld);
  }
  int4_panel_range<M, SYM>(a, K, gs, w, ws, wz, p0, p1, out, ld);
}

// x [M, K] (float32 or bfloat16; any number of rows) times the 4-bit weight in panels
// [P, K/8, 16, 4] with scales [P, G, 16] and zs = scale x zero [P, G, 16] (none: every zero 8),
// both float32 or both float16, plus bias; the result [M, N] in x's dtype.
at::Tensor gemm_int4_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N, const at::Tensor& scales,
                            const std::optional<at::Tensor>& zs, int64_t group_size,
                            const std::optional<at::Tensor>& bias) {
  const char* op = "tandem gemm_int4_panels";
  check_panels(op, x, panels, N, 4, at::kByte, 8, x.size(0));
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), gs = group_size;
  TORCH_CHECK(gs > 0 && gs % 32 == 0 && K % gs == 0, op, ": group_size must be a multiple of 32 that divides K, got ",
              gs, " for K = ", K);
  const int64_t G = K / gs, B = K / 32;
  const bool half = scales.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&scales, zs.has_value() ? &*zs : &scales})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == P && t->size(1) == G && t->size(2) == kPanel,
                op, ": scales and zs must be contiguous [P, K / group_size, 16], both float32 or both float16");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options()), b;
  if (M == 0) return out;
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  std::vector<float> s(M * B), xg(M * G, 0.f);
  std::vector<int32_t> zc(M * B);
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    RowsF32 rows(xc);  // each thread widens into its own row buffer
    for (int64_t m = r0; m < r1; ++m) {
      const float* xm = rows.row(m);
      for (int64_t blk = 0; blk < B; ++blk) {
        int32_t qsum;
        s[m * B + blk] = quantize_block32(xm + blk * 32, q.get() + m * K + blk * 32, &qsum);
        zc[m * B + blk] = -static_cast<int32_t>(kSymZero) * qsum;
        xg[m * G + blk / (gs / 32)] += s[m * B + blk] * static_cast<float>(qsum);
      }
    }
  });
  const Int4PanelRows act{q.get(), s.data(), zc.data(), xg.data()};
  const float* bp = bias_ptr(bias, N, b);
  const uint8_t* wp = panels.data_ptr<uint8_t>();
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  panel_product<float>(
      M, P, N,
      [&](int64_t m0, int64_t m, int64_t c0, int64_t c1, float* acc, int64_t ld) {
        const Int4PanelRows a = act.rows_from(m0, K, G);
        auto run = [&]<typename S>(const S* sp, const S* zp) {
          (zp ? int4_panel_rows<false, S> : int4_panel_rows<true, S>)(static_cast<int>(m), a, K, gs, wp, sp, zp, c0,
                                                                      c1, acc, ld);
        };
        if (half)
          run(reinterpret_cast<const uint16_t*>(scales.data_ptr()),
              zs.has_value() ? reinterpret_cast<const uint16_t*>(zs->data_ptr()) : nullptr);
        else
          run(scales.data_ptr<float>(), zs.has_value() ? zs->data_ptr<float>() : nullptr);
      },
      [&](int64_t m, int64_t n0, __mmask16 mask, const float* sums) {
        __m512 v = _mm512_loadu_ps(sums);
        if (bp) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + n0));
        store16(of, ob, m * N + n0, mask, v);
      });
  return out;
}
#endif  // __AVX512VNNI__ && __AVX512BW__

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
#if defined(__AVX512BF16__)
  m.def("gemm_bf16_panels(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("gemm_bf16_panels_silu_mul(Tensor x, Tensor panels, int intermediate) -> Tensor");
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("gemm_w8a8_panels(Tensor x, Tensor panels, int n, Tensor w_scale, Tensor w_sum, Tensor? bias) -> Tensor");
  m.def("gemm_w8a8_panels_silu_mul(Tensor x, Tensor panels, int intermediate, Tensor w_scale, Tensor w_sum, Tensor? bias) -> Tensor");
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("gemm_int4_panels(Tensor x, Tensor panels, int n, Tensor scales, Tensor? zs, int group_size, Tensor? bias) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
#if defined(__AVX512BF16__)
  m.impl("gemm_bf16_panels", &gemm_bf16_panels);
  m.impl("gemm_bf16_panels_silu_mul", &gemm_bf16_panels_silu_mul);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.impl("gemm_w8a8_panels", &gemm_w8a8_panels);
  m.impl("gemm_w8a8_panels_silu_mul", &gemm_w8a8_panels_silu_mul);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.impl("gemm_int4_panels", &gemm_int4_panels);
#endif
}
