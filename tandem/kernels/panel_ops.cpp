// Few-row bfloat16 products over a weight laid out in column panels, for CPUs with AVX512-BF16 and
// no AMX (AMD Zen 4 / Zen 5, Cooper Lake).
//
// The layout (tandem/model/panels.py packs it): the output columns in panels of 16, each panel
// [K / 2, 16, 2]: for every pair of inputs (2j, 2j + 1), the 16 columns' two weights side by side,
// as `vdpbf16ps` multiplies them against one broadcast pair of an activation row. A panel's 16
// sums then build up in the 16 lanes of one register, with no horizontal sum at the end, and an
// activation pair read once serves every panel in flight: each multiply reads 4 bytes of
// activations where the row-dot form (`gemv_bf16`) reads 64. With several activation rows that
// form reads its activations from L2 once K x rows outgrows L1 and stalls on them; here a weight
// vector meets every row while it is in a register, so up to 16 rows take one pass over the
// weight, the multiplies running beside the stream.

#include <torch/library.h>

#include "kernel_util.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kPanel = 16;  // output columns per panel: one float32 vector of sums
constexpr int kMaxRows = 16;
// Pairs ahead (of 64 bytes each) that each panel stream is prefetched: hardware prefetch alone
// leaves several interleaved streams below memory speed.
constexpr int64_t kAhead = 16;

// Panels multiplied together for M activation rows: M x R accumulators and R weight vectors in at
// most 27 of the 32 vector registers, at most 8 streams. A budget of 30 (all but the broadcast pair
// and one spare) ran 1.05-1.2x slower at 4-16 rows (the compiler spills), 24 no faster.
constexpr int panels_per_block(int m) { return std::min(8, 27 / (m + 1)); }

// acc[m][r] = sum_j x[m] pair j * panel (p + r) pair j, for R panels starting at `w` (panel
// stride K * 16 elements), stored to out[m * ld + r * 16 ...] as float32.
template <int M, int R>
void panel_block(const uint32_t* x, int64_t K2, const uint16_t* w, float* out, int64_t ld) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t stride = K2 * 32;  // elements per panel
  for (int64_t j = 0; j < K2; ++j) {
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w + r * stride + j * 32);
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + (j + kAhead) * 32), _MM_HINT_T0);
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K2 + j]));
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xb, (__m512bh)wv[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + m * ld + r * kPanel, acc[m][r]);
}

// Panels [p0, p1) for M rows: blocks of panels_per_block(M), then the rest one panel at a time.
template <int M>
void panel_range(const uint32_t* x, int64_t K2, const uint16_t* w, int64_t p0, int64_t p1, float* out, int64_t ld) {
  constexpr int R = panels_per_block(M);
  const int64_t stride = K2 * 32;
  int64_t p = p0;
  for (; p + R <= p1; p += R) panel_block<M, R>(x, K2, w + p * stride, out + (p - p0) * kPanel, ld);
  for (; p < p1; ++p) panel_block<M, 1>(x, K2, w + p * stride, out + (p - p0) * kPanel, ld);
}

template <int M = 1>
void panel_rows(int m, const uint32_t* x, int64_t K2, const uint16_t* w, int64_t p0, int64_t p1, float* out, int64_t ld) {
  if constexpr (M < kMaxRows) {
    if (m > M) return panel_rows<M + 1>(m, x, K2, w, p0, p1, out, ld);
  }
  panel_range<M>(x, K2, w, p0, p1, out, ld);
}

// x [M, K] (bfloat16, or float32 rounded to bfloat16) times the weight in panels [P, K/2, 16, 2]
// (N output columns, N <= 16 P), plus bias; float32 accumulation, the result [M, N] in x's dtype.
at::Tensor gemm_bf16_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "tandem gemm_bf16_panels: x must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "tandem gemm_bf16_panels: x must be bfloat16 or float32");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kPanel && panels.size(3) == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16,
              "tandem gemm_bf16_panels: panels must be contiguous bfloat16 [P, K/2, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), K2 = panels.size(1), P = panels.size(0);
  TORCH_CHECK(K == 2 * K2, "tandem gemm_bf16_panels: x has ", K, " columns, the panels ", 2 * K2);
  TORCH_CHECK(N > 16 * (P - 1) && N <= 16 * P, "tandem gemm_bf16_panels: ", N, " columns do not fill ", P, " panels");
  TORCH_CHECK(M <= kMaxRows, "tandem gemm_bf16_panels: at most ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "tandem gemm_bf16_panels: CPU tensors only");
  at::Tensor xb = x.to(at::kBFloat16).contiguous(), b;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  // Chunks of panels per task; the sums stay on the stack until stored.
  constexpr int64_t kChunkPanels = 8;
  at::parallel_for(0, P, 2, [&](int64_t q0, int64_t q1) {
    alignas(64) float acc[kMaxRows * kChunkPanels * kPanel];
    for (int64_t c0 = q0; c0 < q1; c0 += kChunkPanels) {
      const int64_t c1 = std::min(q1, c0 + kChunkPanels), ld = (c1 - c0) * kPanel;
      panel_rows(static_cast<int>(M), xp, K2, wp, c0, c1, acc, ld);
      const int64_t n0 = c0 * kPanel, n1 = std::min(N, c1 * kPanel);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = n0; n < n1; n += kPanel) {
          const int64_t len = std::min(kPanel, n1 - n);
          const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1);
          __m512 v = _mm512_loadu_ps(acc + m * ld + (n - n0));
          if (bp) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + n));
          if (of)
            _mm512_mask_storeu_ps(of + m * N + n, mask, v);
          else
            _mm256_mask_storeu_epi16(ob + m * N + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
  });
  return out;
}
#endif  // __AVX512BF16__

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
#if defined(__AVX512BF16__)
  m.def("gemm_bf16_panels(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
#if defined(__AVX512BF16__)
  m.impl("gemm_bf16_panels", &gemm_bf16_panels);
#endif
}
