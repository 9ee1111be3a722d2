// Helpers the kernel files share: splitting output rows over PyTorch's thread pool, bias and
// bfloat16 conversions, a horizontal sum. Everything is in an anonymous namespace, as in the
// kernel files themselves: each translation unit keeps its own internal copy.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Output rows handled together: four independent weight streams and accumulators.
constexpr int64_t kRowBlock = 4;
// Output rows per epilogue pass: results stay on the stack until scaled and stored.
constexpr int64_t kChunk = 64;

// Runs body(n0, n1) over output rows [0, N) in blocks of kRowBlock on PyTorch's thread pool.
template <typename F>
void for_row_blocks(int64_t N, F&& body) {
  const int64_t blocks = N / kRowBlock;
  if (blocks == 0) {  // fewer outputs than one block: not worth a thread
    if (N > 0) body(0, N);
    return;
  }
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    body(b0 * kRowBlock, b1 == blocks ? N : b1 * kRowBlock);
  });
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as PyTorch does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N, at::Tensor& holder) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == N, "tandem kernels: one bias per output row");
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

// Rows of x ([M, K] float32 or bfloat16, contiguous) as float32: a pointer into x, or into a
// buffer the bfloat16 row is widened into (no converted copy of the whole activation).
class RowsF32 {
 public:
  explicit RowsF32(const at::Tensor& x) : x_(x), K_(x.size(1)) {
    if (x.scalar_type() == at::kBFloat16) buf_.resize(K_);
  }
  const float* row(int64_t m) {
    if (buf_.empty()) return x_.data_ptr<float>() + m * K_;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x_.data_ptr<at::BFloat16>()) + m * K_;
    for (int64_t k = 0; k < K_; ++k) buf_[k] = bf16_to_float(src[k]);
    return buf_.data();
  }

 private:
  const at::Tensor& x_;
  int64_t K_;
  std::vector<float> buf_;
};

#if defined(__AVX2__)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace
