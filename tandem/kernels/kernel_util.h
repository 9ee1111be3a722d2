// Helpers the kernel files share: splitting output rows over PyTorch's thread pool, bias and
// bfloat16 conversions, a horizontal sum, a 16 x 16 register transpose, 4-bit weight checks and
// block dequantization. Everything is in an anonymous namespace, as in the kernel files
// themselves: each translation unit keeps its own internal copy.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

// Before a loop over a block's rows or columns (a trip count the template fixes): unrolled in full,
// so that the block's accumulators stay in registers. Without it GCC keeps part of a large block
// (8 x 3 vectors) on the stack, a load and a store per multiply.
#define TANDEM_UNROLL _Pragma("GCC unroll 32")

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
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

// One row of float32 activations as unsigned 8-bit values with a symmetric scale (max |x| / 127),
// offset by 128 (the unsigned operand of VNNI and AMX products); returns the scale.
inline float quantize_row_u8(const float* row, int64_t K, uint8_t* out) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
  const float s = std::max(amax, 1e-12f) / 127.f;
  const float inv = 1.f / s;
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint(row[k] * inv);
    out[k] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(q, -127.f, 127.f)) + 128);
  }
  return s;
}

// Checks the layout of a paged-attention call (cpu_ops.cpp, amx_attention.cpp); returns the output
// tensor [T, H, D].
inline at::Tensor check_paged(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op, ": q, k, v must be 3-D");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), op,
              ": kv_cache must be a contiguous [2, blocks, block_size, kv_heads, row] tensor");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, op, ": rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(), op,
              ": k, v and the cache must share a dtype");
  TORCH_CHECK(k.size(1) == kv_cache.size(3) && k.size(2) == kv_cache.size(4) && v.size(1) == k.size(1) &&
                  v.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
              op, ": head counts or rows do not match the cache");
  const int64_t T = q.size(0), B = seq_lens.numel();
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && slot_mapping.numel() == T, op, ": one slot per token");
  TORCH_CHECK(query_start_loc.numel() == B + 1 && block_tables.dim() == 2 && block_tables.size(0) == B, op,
              ": one block table row and one query range per request");
  for (const at::Tensor* t : {&slot_mapping, &block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), op, ": index tensors must be contiguous int64");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), BS = kv_cache.size(2);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, op, ": query_start_loc must run from 0 to the token count");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qsl[b + 1] - qsl[b];
    TORCH_CHECK(nq >= 1 && nq <= sl[b] && sl[b] <= max_blocks * BS, op, ": request ", b,
                " has a query range that does not fit its context or block table");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only");
  return at::empty({T, q.size(1), q.size(2)}, q.options());
}

#if defined(__AVX512F__)
// A mask of the first n (0-16) of 16 lanes.
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// float32 -> bfloat16 bits in the low 16 of each 32-bit lane, rounded to nearest even as PyTorch
// rounds (integer arithmetic: no AVX512-BF16 needed; a NaN whose payload lies only in the low 16
// bits would round to infinity).
inline __m512i round_bf16_lanes(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}

// 16 x 16 32-bit transpose in registers: rows r[0..15] become columns.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // u[4i + k], 128-bit lane L: rows 4i..4i+3 of column 4L + k.
  for (int k = 0; k < 4; ++k) {
    const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), v2 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(v2, w2, 0xDD);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 lanes (those in m; the rest 0) of float32 or bfloat16 values as float32.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// quantize_row_u8 on 16 lanes, reading float32 or bfloat16 directly: the same
// operations (max |x| / 127, x times its reciprocal rounded to nearest even, clamped, + 128), so the
// same bytes (a scalar loop costs about a third of a 32-row int8 product).
template <typename T>
inline float quantize_row_u8_16(const T* row, int64_t K, uint8_t* out) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = first_lanes(std::min<int64_t>(16, K - k));
    amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + k, m)));
  }
  const float s = std::max(_mm512_reduce_max_ps(amax), 1e-12f) / 127.f;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = first_lanes(std::min<int64_t>(16, K - k));
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + k, m), inv));  // rounds to nearest even
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), offset);
    _mm_mask_storeu_epi8(out + k, m, _mm512_cvtepi32_epi8(q));
  }
  return s;
}

// Every row of x ([M, K] float32 or bfloat16, contiguous) through quantize_row_u8_16 on PyTorch's
// thread pool: row m's bytes at out + m * ld (ld >= K), its scale at scale[m].
inline void quantize_rows_u8_16(const at::Tensor& x, uint8_t* out, int64_t ld, float* scale) {
  const int64_t M = x.size(0), K = x.size(1);
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      if (x.scalar_type() == at::kFloat)
        scale[m] = quantize_row_u8_16(x.data_ptr<float>() + m * K, K, out + m * ld);
      else
        scale[m] = quantize_row_u8_16(reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * K, K, out + m * ld);
    }
  });
}
#endif

// 4-bit weights (tandem/model/int4.py's layout: qweight [N, K/2], 32-element blocks of 16 bytes,
// low nibbles elements 0..15, high 16..31; scales and zs = scale * zero [N, K / group_size]).
// The zero point of every group when no zs is given.
constexpr float kSymZero = 8.f;

// zs's data, or nullptr for a symmetric weight.
inline const float* check_int4(const char* op, const at::Tensor& qw, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zs, int64_t group_size) {
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kByte && qw.is_contiguous(), op,
              ": qweight must be a contiguous uint8 [N, K/2] tensor");
  const int64_t N = qw.size(0), K = qw.size(1) * 2;
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0, op,
              ": group_size must be a multiple of 32 that divides K, got ", group_size, " for K = ", K);
  for (const at::Tensor* t : {&scales, zs.has_value() ? &*zs : &scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / group_size,
                op, ": scales and zs must be contiguous float32 [N, K / group_size]");
  return zs.has_value() ? zs->data_ptr<float>() : nullptr;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One 32-element block as float32, q * s - z: elements 0..15 in lo, 16..31 in hi.
inline void int4_block_f32(const uint8_t* blk, __m512 s, __m512 z, __m512& lo, __m512& hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  lo = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4))), s, z);
  hi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4))), s, z);
}
#endif

#if defined(__AVX2__)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of four accumulators, stored to out[0..3]. Summed together (interleave, add, then fold
// the 128-bit lanes once for all four) they take about a third of the instructions of four
// separate horizontal sums: a one-row product over a short row (K = 896: 14 multiply-adds a weight
// row in int8) otherwise spends a good part of its time in the epilogue.
inline void sum4(const __m256 (&a)[4], float* out) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

inline void sum4(const __m256i (&a)[4], int32_t* out) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}

inline int32_t hsum256_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Quantizes 32 floats to int8 (round to nearest even, scale max|x| / 127); returns the scale and
// stores the sum of the int8 values in *qsum.
inline float quantize_block32(const float* x, int8_t* dst, int32_t* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float mx = _mm_cvtss_f32(m);
  const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *qsum = _mm_cvtsi128_si32(s4);
  // The packs interleave 128-bit lanes; the permute puts the 32 bytes back in order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return mx / 127.f;
}
#endif

#if defined(__AVX512F__)
inline void sum4(const __m512 (&a)[4], float* out) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  // Each 128-bit lane now holds its part of a[0], a[1], a[2], a[3] in that order.
  __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
  u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
  _mm_storeu_ps(out, _mm512_castps512_ps128(u));
}

inline void sum4(const __m512i (&a)[4], int32_t* out) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
  __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  u = _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  u = _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_castsi512_si128(u));
}
#endif

#if defined(__AMX_TILE__)
// Linux hands out the AMX register state only to a process that asked for it.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// The operand of `ldtilecfg` (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int n_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(n_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
  // GCC's ldtilecfg builtin does not tell the optimizer it reads the operand: without the barrier
  // the stores above can be dropped and the instruction faults on whatever the stack held.
  void load() const {
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};
#endif

}  // namespace
