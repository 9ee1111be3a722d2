// 4-bit weight kernels (AWQ, GPTQ, compressed-tensors checkpoints, repacked at load by
// tandem/model/int4.py): dequantization for large batches and a few-row product that reads the
// packed weight once, with an AVX2 form and an AVX512-VNNI form.
//
// Layout: qweight [N, K/2] bytes; each 32-element block of a weight row is 16 bytes whose low
// nibbles are elements 0..15 and high nibbles elements 16..31, unsigned (0..15). Element k of row
// n is (q - zero) * scale of its group: scales [N, G] and zs = scale * zero [N, G], float32,
// G = K / group_size. Symmetric checkpoints (every zero 8, as GPTQ's `sym` writes them) pass no
// zs: the kernels then read 8 * scale, and the product streams 8 fewer bytes per group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernel_util.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One 32-element block with AVX-512: the nibbles widened to 32-bit lanes, q * s - z in float32,
// and for bfloat16 rounded to nearest even as PyTorch's conversion rounds (the compiler does not
// vectorise the scalar loop below's bfloat16 conversion: 10x slower).
template <typename E>
inline void dequant_block_avx512(const uint8_t* blk, __m512 s, __m512 z, E* o) {
  __m512 lo, hi;
  int4_block_f32(blk, s, z, lo, hi);
  if constexpr (std::is_same_v<E, float>) {
    _mm512_storeu_ps(o, lo);
    _mm512_storeu_ps(o + 16, hi);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(round_bf16_lanes(lo)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm512_cvtepi32_epi16(round_bf16_lanes(hi)));
  }
}
#endif

// Dequantize to float32 or bfloat16 [N, K] (the large-batch path multiplies that with a GEMM).
template <typename E>
void dequant_int4_impl(const uint8_t* qw, const float* sc, const float* zs, int64_t N, int64_t K, int64_t gs, E* out) {
  const int64_t G = K / gs;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = qw + n * (K / 2);
      E* orow = out + n * K;
      for (int64_t g = 0; g < G; ++g) {
        const float s = sc[n * G + g], z = zs ? zs[n * G + g] : kSymZero * s;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
        for (int64_t b = g * gs / 32; b < (g + 1) * gs / 32; ++b) dequant_block_avx512(wr + b * 16, sv, zv, orow + b * 32);
#else
        for (int64_t b = g * gs / 32; b < (g + 1) * gs / 32; ++b) {
          const uint8_t* blk = wr + b * 16;
          E* o = orow + b * 32;
#pragma omp simd
          for (int64_t j = 0; j < 16; ++j) {
            o[j] = static_cast<E>(static_cast<float>(blk[j] & 0x0F) * s - z);
            o[j + 16] = static_cast<E>(static_cast<float>(blk[j] >> 4) * s - z);
          }
        }
#endif
      }
    }
  });
}


// Writes into `out` ([N, K] float32 or bfloat16, contiguous): callers reuse one buffer, so a large
// weight is not a fresh allocation (and its page faults) on every call.
at::Tensor dequant_int4(const at::Tensor& qw, const at::Tensor& scales, const std::optional<at::Tensor>& zs,
                        int64_t group_size, at::Tensor out) {
  const float* zp = check_int4("tandem dequant_int4", qw, scales, zs, group_size);
  const int64_t N = qw.size(0), K = qw.size(1) * 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "tandem dequant_int4: out must be a contiguous [N, K] tensor");
  if (out.scalar_type() == at::kFloat) {
    dequant_int4_impl<float>(qw.data_ptr<uint8_t>(), scales.data_ptr<float>(), zp, N, K,
                             group_size, out.data_ptr<float>());
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "tandem dequant_int4: float32 or bfloat16 output only");
    dequant_int4_impl<at::BFloat16>(qw.data_ptr<uint8_t>(), scales.data_ptr<float>(), zp, N, K,
                                    group_size, out.data_ptr<at::BFloat16>());
  }
  return out;
}


#if defined(__AVX2__) && defined(__FMA__)
// Activations are quantized to int8 in blocks of 32 (one symmetric scale per block, as
// llama.cpp's Q8 blocks), so a block's product with the unsigned 4-bit weights is integer
// instructions: `vpmaddubsw` (u8 x s8 pairs, at most 2 * 15 * 127 = 3810, so two of them add in
// 16 bits without saturating) and `vpmaddwd`. Within a group the blocks go in pairs ("units"): one
// 32-byte weight load holds two blocks, whose low nibbles (elements 0..15 of each) and high
// nibbles (16..31) are one AND and one shift + AND away, and the activations are laid out to match
// (per pair: both blocks' 0..15, then both blocks' 16..31). A group with an odd block count ends
// in a single-block unit (its 16 bytes in both 128-bit lanes, the upper shifted by 4).
//
// The block scales stay in integers: up to kInt4ChunkUnits units form a chunk with one float
// scale S (the largest block scale / 2^14), and each block's scale is S times a 15-bit integer
// r_b (relative error <= 2^-15 of S, far below the int8 rounding). `vpmaddwd` multiplies the
// 16-bit pair sums by r_b instead of by ones, so a chunk sums in int32 (at most
// 4 * 2 * 7620 * 2^14 < 2^31) and converts to float once, scaled by S and the weight group's
// scale. The zero points come out once per group as zs * sum(x over the group).
constexpr int64_t kInt4ChunkUnits = 4;
constexpr float kInt4RScale = 16384.f;

struct Int4Act {  // one activation matrix, quantized and laid out for int4_rows
  std::vector<int8_t> q;    // [M, K], pair-interleaved as above
  std::vector<int16_t> r;   // [M, units, 16]: each unit's lanes' r_b
  std::vector<float> cs;    // [M, chunks]: each chunk's S
  std::vector<float> xg;    // [M, G]: sum over each group of the activations as quantized
  int64_t units = 0, chunks = 0;  // per row
};


// A chunk's activation scales in integers: returns S = the largest block scale / 2^14 and sets
// rb[b] = round(bs[b] / max * 2^14), so block b's scale is S * rb[b].
inline float chunk_scales(const float* bs, int64_t n, int16_t* rb) {
  float smax = 0.f;
  for (int64_t b = 0; b < n; ++b) smax = std::max(smax, bs[b]);
  for (int64_t b = 0; b < n; ++b) {
    const float rel = smax > 0.f ? bs[b] / smax * kInt4RScale : 0.f;
    rb[b] = static_cast<int16_t>(std::nearbyint(rel));
  }
  return smax / kInt4RScale;
}

void quantize_int4_act(RowsF32& x, int64_t M, int64_t K, int64_t gs, Int4Act& a) {
  const int64_t G = K / gs, bpg = gs / 32, upg = bpg / 2 + bpg % 2;
  const int64_t cpg = (upg + kInt4ChunkUnits - 1) / kInt4ChunkUnits;
  a.units = G * upg;
  a.chunks = G * cpg;
  a.q.resize(M * K);
  a.r.resize(M * a.units * 16);
  a.cs.resize(M * a.chunks);
  a.xg.assign(M * G, 0.f);
  alignas(32) int8_t blk[2 * kInt4ChunkUnits][32];
  float bs[2 * kInt4ChunkUnits];
  int32_t qs[2 * kInt4ChunkUnits];
  int16_t rb[2 * kInt4ChunkUnits];
  for (int64_t m = 0; m < M; ++m) {
    int8_t* q = a.q.data() + m * K;
    int16_t* r = a.r.data() + m * a.units * 16;
    float* cs = a.cs.data() + m * a.chunks;
    const float* xm = x.row(m);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t u0 = 0; u0 < upg; u0 += kInt4ChunkUnits, ++cs) {
        const int64_t b0 = u0 * 2, b1 = std::min(bpg, (u0 + kInt4ChunkUnits) * 2);
        for (int64_t b = b0; b < b1; ++b)
          bs[b - b0] = quantize_block32(xm + (g * bpg + b) * 32, blk[b - b0], &qs[b - b0]);
        const float S = chunk_scales(bs, b1 - b0, rb);
        *cs = S;
        for (int64_t b = b0; b < b1; ++b)
          a.xg[m * G + g] += S * static_cast<float>(rb[b - b0]) * static_cast<float>(qs[b - b0]);
        for (int64_t b = b0; b < b1; b += 2, r += 16) {
          const int64_t i = b - b0;
          if (b + 1 == bpg) {  // the group's odd block: natural order, one r_b in every lane
            std::memcpy(q, blk[i], 32);
            for (int j = 0; j < 16; ++j) r[j] = rb[i];
            q += 32;
            continue;
          }
          std::memcpy(q, blk[i], 16);
          std::memcpy(q + 16, blk[i + 1], 16);
          std::memcpy(q + 32, blk[i] + 16, 16);
          std::memcpy(q + 48, blk[i + 1] + 16, 16);
          for (int j = 0; j < 8; ++j) {
            r[j] = rb[i];
            r[j + 8] = rb[i + 1];
          }
          q += 64;
        }
      }
    }
  }
}

// Rows of 448 to 2432 bytes (K = 896..4864) are too short for the hardware prefetcher to ramp up
// on, so the kernel prefetches itself, this many rows ahead: far enough to cover a memory latency
// at two threads' streaming rate, near enough to stay in L1/L2. A sweep over NR adjacent rows
// reads one contiguous window of NR rows, four streams at a time; its prefetches walk the window
// kInt4Ahead rows on in address order instead (NR * 32 bytes per unit step), which keeps more of
// memory's bandwidth than prefetching each row's bytes at the same offset.
constexpr int64_t kInt4Ahead = 8;

// out[m * ld + (n - n0)] = x_m . w_n for MR activation rows (from row m0 of `a`) and output rows
// [n0, n1), NR weight rows at a time (independent accumulator chains; each unit's activations
// are read once for all of them). UPG > 0: every group is exactly UPG two-block units and one chunk
// (groups of 64, 128 or 256), so the unit loop has a fixed trip count the compiler unrolls; with
// groups of 128 the generic loop's set-up and exit cost as much as its two iterations' work.
template <int MR, int NR, int UPG = 0>
void int4_rows(const Int4Act& a, int64_t m0, int64_t K, int64_t gs, const uint8_t* qw, const float* sc,
               const float* zs, int64_t n0, int64_t n1, float* out, int64_t ld) {
  const int64_t G = K / gs, bpg = gs / 32, U = a.units, C = a.chunks, KH = K / 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int8_t* xq = a.q.data() + m0 * K;
  const int16_t* rq = a.r.data() + m0 * U * 16;
  const float* cs = a.cs.data() + m0 * C;
  const float* xg = a.xg.data() + m0 * G;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 tot[MR][NR];
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      #pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) tot[m][j] = _mm256_setzero_ps();
    const uint8_t* wr = qw + n * KH;
    const int8_t* xp = xq;
    const int16_t* rp = rq;
    const float* cp = cs;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t b0 = 0; b0 < bpg; b0 += 2 * kInt4ChunkUnits, ++cp) {
        const int64_t b1 = UPG > 0 ? 2 * UPG : std::min(bpg, b0 + 2 * kInt4ChunkUnits);
        __m256i isum[MR][NR];
        #pragma GCC unroll 4
        for (int m = 0; m < MR; ++m)
          #pragma GCC unroll 4
          for (int j = 0; j < NR; ++j) isum[m][j] = _mm256_setzero_si256();
        int64_t b = b0;
        #pragma GCC unroll 4
        for (; b + 1 < b1; b += 2, rp += 16, wr += 32, xp += 64) {
          {
            const uint8_t* pf = qw + (n + kInt4Ahead) * KH + (wr - (qw + n * KH)) * NR;
            #pragma GCC unroll 4
            for (int l = 0; l < NR * 32; l += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + l), _MM_HINT_T0);
          }
          #pragma GCC unroll 4
          for (int j = 0; j < NR; ++j) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * KH));
            const __m256i lo = _mm256_and_si256(raw, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            #pragma GCC unroll 4
            for (int m = 0; m < MR; ++m) {
              const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K));
              const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K + 32));
              const __m256i rv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp + m * U * 16));
              const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
              isum[m][j] = _mm256_add_epi32(isum[m][j], _mm256_madd_epi16(p, rv));
            }
          }
        }
        if (UPG == 0 && b < b1) {  // the group's odd block
          const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
          #pragma GCC unroll 4
          for (int j = 0; j < NR; ++j) {
            const __m256i raw =
                _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + j * KH)));
            const __m256i w = _mm256_and_si256(_mm256_srlv_epi32(raw, shift), low4);
            #pragma GCC unroll 4
            for (int m = 0; m < MR; ++m) {
              const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K));
              const __m256i rv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp + m * U * 16));
              isum[m][j] = _mm256_add_epi32(isum[m][j], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), rv));
            }
          }
          rp += 16;
          wr += 16;
          xp += 32;
        }
        #pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          const __m256 s = _mm256_broadcast_ss(sc + (n + j) * G + g);
          #pragma GCC unroll 4
          for (int m = 0; m < MR; ++m) {
            const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[m][j]), _mm256_broadcast_ss(cp + m * C));
            tot[m][j] = _mm256_fmadd_ps(f, s, tot[m][j]);
          }
        }
      }
    }
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      #pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const float* z = zs ? zs + (n + j) * G : sc + (n + j) * G;
        float corr = 0.f;
        for (int64_t g = 0; g < G; ++g) corr += z[g] * xg[m * G + g];
        out[m * ld + (n + j - n0)] = hsum256(tot[m][j]) - (zs ? corr : kSymZero * corr);
      }
  }
  if (n < n1) int4_rows<MR, 1, UPG>(a, m0, K, gs, qw, sc, zs, n, n1, out + (n - n0), ld);
}

// Activation rows per sweep of the weight, and weight rows per step for each row count: at most
// four accumulator pairs, so the sweep stays in the 16 vector registers.
constexpr int64_t kInt4Sweep = 4;

using Int4RowsFn = void (*)(const Int4Act&, int64_t, int64_t, int64_t, const uint8_t*, const float*, const float*,
                            int64_t, int64_t, float*, int64_t);
// The kernel for 1, 2, 3 and 4 activation rows (weight rows per step as the registers allow).
template <int UPG>
constexpr Int4RowsFn kInt4Kernels[4] = {int4_rows<1, 4, UPG>, int4_rows<2, 2, UPG>, int4_rows<3, 1, UPG>,
                                        int4_rows<4, 1, UPG>};

// AVX2 kernel for `rows` (1..kInt4Sweep) activation rows and groups of `gs`.
Int4RowsFn int4_kernel(int64_t rows, int64_t gs) {
  // Groups of two-block units that make one chunk (64, 128, 256 elements) take the fixed-trip kernels.
  const int64_t bpg = gs / 32, upg = bpg % 2 == 0 && bpg <= 2 * kInt4ChunkUnits ? bpg / 2 : 0;
  const int64_t i = std::min<int64_t>(rows, kInt4Sweep) - 1;
  switch (upg) {
    case 1: return kInt4Kernels<1>[i];
    case 2: return kInt4Kernels<2>[i];
    case 4: return kInt4Kernels<4>[i];
    default: return kInt4Kernels<0>[i];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// With AVX512-VNNI one 64-byte weight load holds four blocks (a "quad", 128 elements): an AND and
// a shift + AND give their low and high nibbles, and two `vpdpbusd` multiply those by the matching
// int8 activations (laid out per quad: the four blocks' elements 0..15, then their 16..31) and sum
// them in int32, each 128-bit lane one block. The lanes are then converted to float and scaled by
// their block's activation scale times the weight group's scale: a convert, a multiply and an FMA
// per quad. The activation scales are the AVX2 kernel's (a chunk's S times a 15-bit integer), so
// both kernels compute the same sums up to float rounding order. A symmetric weight's zero point
// (8) comes out in integers before the scaling: each block's sum starts at -8 times the sum of its
// int8 activations, so the row needs no per-group correction afterwards.
struct Int4ActQuads {  // one activation matrix, quantized and laid out for int4_rows_vnni
  std::vector<int8_t> q;  // [M, quads, 128]: zero past the row's last block
  std::vector<float> s;   // [M, quads, 16]: lanes 4i..4i+3 hold block 4q+i's scale
  std::vector<float> xg;  // [M, G]: sum over each group of the activations as quantized
  // [M, quads, 16]: a symmetric weight's zero point taken out in integers, -8 * (sum of block
  // 4q+i's int8 activations) in lane 4i, where the block's products start their sums.
  std::vector<int32_t> zc;
  int64_t quads = 0;  // per row
};

void quantize_int4_quads(RowsF32& x, int64_t M, int64_t K, int64_t gs, Int4ActQuads& a) {
  const int64_t G = K / gs, bpg = gs / 32, Q = (K / 32 + 3) / 4;
  a.quads = Q;
  a.q.assign(M * Q * 128, 0);
  a.s.assign(M * Q * 16, 0.f);
  a.xg.assign(M * G, 0.f);
  a.zc.assign(M * Q * 16, 0);
  alignas(32) int8_t blk[2 * kInt4ChunkUnits][32];
  float bs[2 * kInt4ChunkUnits];
  int32_t qs[2 * kInt4ChunkUnits];
  int16_t rb[2 * kInt4ChunkUnits];
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x.row(m);
    int8_t* q = a.q.data() + m * Q * 128;
    float* s = a.s.data() + m * Q * 16;
    int32_t* zc = a.zc.data() + m * Q * 16;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t b0 = 0; b0 < bpg; b0 += 2 * kInt4ChunkUnits) {  // the AVX2 kernel's chunks
        const int64_t b1 = std::min(bpg, b0 + 2 * kInt4ChunkUnits);
        for (int64_t b = b0; b < b1; ++b)
          bs[b - b0] = quantize_block32(xm + (g * bpg + b) * 32, blk[b - b0], &qs[b - b0]);
        const float S = chunk_scales(bs, b1 - b0, rb);
        for (int64_t b = b0; b < b1; ++b) {
          const float scale = S * static_cast<float>(rb[b - b0]);
          a.xg[m * G + g] += scale * static_cast<float>(qs[b - b0]);
          const int64_t block = g * bpg + b, quad = block / 4, i = block % 4;
          std::memcpy(q + quad * 128 + i * 16, blk[b - b0], 16);
          std::memcpy(q + quad * 128 + 64 + i * 16, blk[b - b0] + 16, 16);
          for (int l = 0; l < 4; ++l) s[quad * 16 + i * 4 + l] = scale;
          zc[quad * 16 + i * 4] = -static_cast<int32_t>(kSymZero) * qs[b - b0];
        }
      }
    }
  }
}

// The weight group scales of a quad's 16 lanes: SPQ = 1 (groups of 128 or more: one scale),
// 2 (groups of 64) or 4 (groups of 32) consecutive scales from `sc`, `mask` of them present.
template <int SPQ>
inline __m512 quad_weight_scales(const float* sc, __mmask8 mask) {
  if constexpr (SPQ == 1) {
    return _mm512_set1_ps(*sc);
  } else {
    const __m512i idx = SPQ == 2 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                 : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(mask, sc)));
  }
}

// One quad of NR weight rows (raw bytes `w[j]`, their scales from sq[j * G]) times MR activation
// rows (quads `xq`, lane scales `xs` and, for a symmetric weight (SYM), zero-point lanes `zc`;
// rows Q quads apart), accumulated into tot.
template <int MR, int NR, int SPQ, bool SYM>
inline void int4_quad(__m512 (&tot)[MR][NR], const __m512i (&w)[NR], const int8_t* xq, const float* xs,
                      const int32_t* zc, const float* sq, int64_t G, int64_t Q, __mmask8 smask) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  #pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const __m512i lo = _mm512_and_si512(w[j], low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w[j], 4), low4);
    const __m512 ws = quad_weight_scales<SPQ>(sq + j * G, smask);
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const int8_t* xm = xq + m * Q * 128;
      const __m512i start = SYM ? _mm512_loadu_si512(zc + m * Q * 16) : _mm512_setzero_si512();
      __m512i acc = _mm512_dpbusd_epi32(start, lo, _mm512_loadu_si512(xm));
      acc = _mm512_dpbusd_epi32(acc, hi, _mm512_loadu_si512(xm + 64));
      const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(xs + m * Q * 16), ws);
      tot[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, tot[m][j]);
    }
  }
}

inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// out[m * ld + (n - n0)] = x_m . w_n for MR activation rows (from row m0 of `a`) and output rows
// [n0, n1), NR weight rows at a time; prefetching as int4_rows does (NR * 64 bytes per quad).
template <int MR, int NR, int SPQ, bool SYM>
void int4_rows_vnni(const Int4ActQuads& a, int64_t m0, int64_t K, int64_t gs, const uint8_t* qw, const float* sc,
                    const float* zs, int64_t n0, int64_t n1, float* out, int64_t ld) {
  const int64_t G = K / gs, KH = K / 2, Q = a.quads, full = K / 128;
  const int64_t qpg = SPQ == 1 ? gs / 128 : 1;  // quads per weight group
  const int tail = static_cast<int>((K / 32) % 4);  // blocks in a last, partial quad
  const __mmask64 tail_bytes = (1ull << (16 * tail)) - 1;
  const __mmask8 all_scales = static_cast<__mmask8>((1u << SPQ) - 1);
  const __mmask8 tail_scales = static_cast<__mmask8>((1u << (tail * SPQ / 4)) - 1);
  const int8_t* xq = a.q.data() + m0 * Q * 128;
  const float* xs = a.s.data() + m0 * Q * 16;
  const float* xg = a.xg.data() + m0 * G;
  const int32_t* zc = a.zc.data() + m0 * Q * 16;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m512 tot[MR][NR];
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) tot[m][j] = _mm512_setzero_ps();
    const uint8_t* wr = qw + n * KH;
    const float* sr = sc + n * G;
    __m512i w[NR];
    int64_t g = 0, gq = 0;  // SPQ 1: quad q's group, and its place in the group
    for (int64_t q = 0; q < full; ++q) {
      const uint8_t* pf = qw + (n + kInt4Ahead) * KH + q * 64 * NR;
      #pragma GCC unroll 8
      for (int l = 0; l < NR; ++l) _mm_prefetch(reinterpret_cast<const char*>(pf + l * 64), _MM_HINT_T0);
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_si512(wr + j * KH + q * 64);
      int4_quad<MR, NR, SPQ, SYM>(tot, w, xq + q * 128, xs + q * 16, zc + q * 16, SPQ == 1 ? sr + g : sr + q * SPQ, G,
                                  Q, all_scales);
      if (SPQ == 1 && ++gq == qpg) {
        gq = 0;
        ++g;
      }
    }
    if (tail) {
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) w[j] = _mm512_maskz_loadu_epi8(tail_bytes, wr + j * KH + full * 64);
      int4_quad<MR, NR, SPQ, SYM>(tot, w, xq + full * 128, xs + full * 16, zc + full * 16, sr + full * SPQ, G, Q,
                                  tail_scales);
    }
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j)
        out[m * ld + (n + j - n0)] =
            _mm512_reduce_add_ps(tot[m][j]) - (SYM ? 0.f : dot_f32(zs + (n + j) * G, xg + m * G, G));
  }
  if (n < n1) int4_rows_vnni<MR, 1, SPQ, SYM>(a, m0, K, gs, qw, sc, zs, n, n1, out + (n - n0), ld);
}

using Int4VnniFn = void (*)(const Int4ActQuads&, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                            const float*, int64_t, int64_t, float*, int64_t);
// 1, 2, 3 and 4 activation rows: weight rows per step as the 32 vector registers allow.
template <int SPQ, bool SYM>
constexpr Int4VnniFn kInt4VnniKernels[4] = {int4_rows_vnni<1, 4, SPQ, SYM>, int4_rows_vnni<2, 4, SPQ, SYM>,
                                            int4_rows_vnni<3, 2, SPQ, SYM>, int4_rows_vnni<4, 2, SPQ, SYM>};

// Scales per quad for groups of gs, or 0 where the quads do not line up with the groups (the AVX2
// kernel takes those).
int64_t scales_per_quad(int64_t gs) { return gs % 128 == 0 ? 1 : gs == 64 ? 2 : gs == 32 ? 4 : 0; }

template <bool SYM>
Int4VnniFn int4_vnni_kernel(int64_t rows, int64_t spq) {
  const int64_t i = std::min<int64_t>(rows, kInt4Sweep) - 1;
  return spq == 1 ? kInt4VnniKernels<1, SYM>[i] : spq == 2 ? kInt4VnniKernels<2, SYM>[i] : kInt4VnniKernels<4, SYM>[i];
}
#endif  // __AVX512VNNI__ && __AVX512BW__

// Runs kernel(rows, m0, c0, c1, acc, width) over the output in chunks of kChunk rows per thread
// and kInt4Sweep activation rows per sweep; store(m, n, value) takes each result.
template <typename Kernel, typename Store>
void int4_product(int64_t M, int64_t N, Kernel&& kernel, Store&& store) {
  for_row_blocks(N, [&](int64_t n0, int64_t n1) {
    float acc[kInt4Sweep * kChunk];
    for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
      const int64_t c1 = std::min(n1, c0 + kChunk), width = c1 - c0;
      for (int64_t m0 = 0; m0 < M; m0 += kInt4Sweep) {
        const int64_t rows = std::min<int64_t>(kInt4Sweep, M - m0);
        kernel(rows, m0, c0, c1, acc, width);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t n = c0; n < c1; ++n) store(m0 + r, n, acc[r * width + (n - c0)]);
      }
    }
  });
}

// x [M, K] (float32 or bfloat16) times the 4-bit weight [N, K] (layout above), plus bias; the
// result in x's dtype.
at::Tensor gemm_int4(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                     const std::optional<at::Tensor>& zs, int64_t group_size, const std::optional<at::Tensor>& bias) {
  const char* op = "tandem gemm_int4";
  const float* zp = check_int4(op, qw, scales, zs, group_size);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0), gs = group_size;
  TORCH_CHECK(K == qw.size(1) * 2, op, ": x has ", K, " columns, the weight ", qw.size(1) * 2);
  const at::Tensor xc = x.contiguous();
  RowsF32 rows(xc);
  at::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  uint16_t* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  auto store = [&](int64_t m, int64_t n, float v) {
    v += bp ? bp[n] : 0.f;
    if (of)
      of[m * N + n] = v;
    else
      ob[m * N + n] = float_to_bf16(v);
  };
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (const int64_t spq = scales_per_quad(gs)) {
    Int4ActQuads act;
    quantize_int4_quads(rows, M, K, gs, act);
    int4_product(
        M, N,
        [&](int64_t r, int64_t m0, int64_t c0, int64_t c1, float* acc, int64_t width) {
          (zp ? int4_vnni_kernel<false> : int4_vnni_kernel<true>)(r, spq)(act, m0, K, gs, wp, sp, zp, c0, c1, acc,
                                                                         width);
        },
        store);
    return out;
  }
#endif
  Int4Act act;
  quantize_int4_act(rows, M, K, gs, act);
  int4_product(
      M, N,
      [&](int64_t r, int64_t m0, int64_t c0, int64_t c1, float* acc, int64_t width) {
        int4_kernel(r, gs)(act, m0, K, gs, wp, sp, zp, c0, c1, acc, width);
      },
      store);
  return out;
}
#endif  // __AVX2__ && __FMA__

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("dequant_int4(Tensor qweight, Tensor scales, Tensor? zs, int group_size, Tensor(a!) out) -> Tensor(a!)");
#if defined(__AVX2__) && defined(__FMA__)
  m.def("gemm_int4(Tensor x, Tensor qweight, Tensor scales, Tensor? zs, int group_size, Tensor? bias) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("dequant_int4", &dequant_int4);
#if defined(__AVX2__) && defined(__FMA__)
  m.impl("gemm_int4", &gemm_int4);
#endif
}
