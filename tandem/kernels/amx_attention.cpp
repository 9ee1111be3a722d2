// Attention over a bfloat16 paged KV cache on AMX tiles, for queries of any length: prompt chunks
// as well as decodes and verifications (CPUs with AMX; head_dim 64 or 128; blocks of a multiple of
// 16 tokens; no sliding window, which the portable kernel in cpu_ops.cpp keeps).
//
// Per (request, KV head), the keys and values of its context are first laid out once in the tiles'
// order (keys transposed, values in pairs of positions), then every tile of 16 query vectors
// (query tokens x the GQA group) of that request is scored, softmaxed and multiplied in tiles:
//   scores S^T [16 queries x 16 positions] = Q [16 x head_dim] . K^T, row by row a query's scores;
//   probabilities rounded to bfloat16 in place become the left operand of P . V directly.
// A prompt chunk's hundreds of query tiles share one layout of its context, which makes this a
// flash-attention-like product at tile speed; the whole score row of a tile is held (16 x context
// floats), so no running rescaling is needed.

#include <torch/library.h>

#include "exp_approx.h"
#include "kernel_util.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace {

constexpr int64_t kT = 16;  // tile rows and 32-bit columns

// All six tiles 16 rows of 64 bytes. Scores: 0 = S^T, 1 = a key tile, 2-5 = the queries' blocks of
// 32 head elements. Values: 0 = a block of 32 probabilities per query, 1 = a value tile, 2-5 = the
// output's blocks of 16 head elements.
void configure_attention_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.set(t, kT, 64);
  _tile_loadconfig(&cfg);
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

// One (request, KV head)'s context in tile order. keys: per 16 positions and 32 head elements, a
// 1 KB tile whose row r holds, for each position, its elements 2r and 2r + 1. values: per 32
// positions and 16 head elements, a tile whose row r holds, for each element, positions 2r and
// 2r + 1. Positions past the context are zero (a zero probability times them stays zero).
struct PackedContext {
  std::vector<uint32_t> keys, values;
};

void pack_context(const uint16_t* const* krows, const uint16_t* const* vrows, int64_t span, int64_t D,
                  PackedContext& out) {
  const int64_t kblocks = (span + kT - 1) / kT, vblocks = (span + 2 * kT - 1) / (2 * kT);
  const int64_t dk = D / 32, dv = D / 16;  // key tiles per 16 positions, value tiles per 32
  out.keys.resize(kblocks * dk * kT * kT);
  out.values.resize(vblocks * dv * kT * kT);
  for (int64_t pb = 0; pb < kblocks; ++pb) {
    for (int64_t blk = 0; blk < dk; ++blk) {
      __m512i r[16];
      for (int64_t p = 0; p < kT; ++p) {
        const int64_t pos = pb * kT + p;
        r[p] = pos < span ? _mm512_loadu_si512(krows[pos] + blk * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* tile = out.keys.data() + (pb * dk + blk) * kT * kT;
      for (int64_t i = 0; i < kT; ++i) _mm512_storeu_si512(tile + i * kT, r[i]);
    }
  }
  for (int64_t pb = 0; pb < vblocks; ++pb) {
    for (int64_t i = 0; i < kT; ++i) {
      const int64_t p0 = pb * 2 * kT + 2 * i, p1 = p0 + 1;
      for (int64_t blk = 0; blk < dv; ++blk) {
        const __m256i zero = _mm256_setzero_si256();
        const __m256i a = p0 < span ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrows[p0] + blk * 16)) : zero;
        const __m256i b = p1 < span ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrows[p1] + blk * 16)) : zero;
        const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        _mm512_storeu_si512(out.values.data() + ((pb * dv + blk) * kT + i) * kT, pair);
      }
    }
  }
}

// One tile of 16 query vectors (qrows[c]: query vector c, null for padding) against a packed
// context; hi[c]: the last position query c sees (causal). Writes the normalized output rows.
void attend_tile(const uint16_t* const* qrows, const int64_t* hi, int64_t nc, const PackedContext& ctx, int64_t D,
                 float scale, std::vector<float>& scores, std::vector<uint16_t>& probs, uint16_t* const* orows) {
  int64_t span = 0;
  for (int64_t c = 0; c < nc; ++c) span = std::max(span, hi[c] + 1);
  const int64_t kblocks = (span + kT - 1) / kT, vblocks = (span + 2 * kT - 1) / (2 * kT);
  const int64_t width = vblocks * 2 * kT;  // a score row, padded to whole value tiles
  // Row strides off powers of two: 16 tile rows 2 or 4 KB apart would share L1 sets.
  const int64_t lds = width + kT, ldp = width + 2 * kT;
  scores.resize(kT * lds);
  probs.resize(kT * ldp);
  const int64_t dk = D / 32, dv = D / 16;
  alignas(64) uint16_t qa[kT * 128];
  for (int64_t c = 0; c < kT; ++c) {
    if (c < nc)
      std::memcpy(qa + c * D, qrows[c], D * sizeof(uint16_t));
    else
      std::memset(qa + c * D, 0, D * sizeof(uint16_t));
  }
  _tile_loadd(2, qa, D * 2);
  _tile_loadd(3, qa + 32, D * 2);
  if (dk == 4) {
    _tile_loadd(4, qa + 64, D * 2);
    _tile_loadd(5, qa + 96, D * 2);
  }
  for (int64_t pb = 0; pb < kblocks; ++pb) {
    const uint32_t* kt = ctx.keys.data() + pb * dk * kT * kT;
    _tile_zero(0);
    _tile_loadd(1, kt, 64);
    _tile_dpbf16ps(0, 2, 1);
    _tile_loadd(1, kt + kT * kT, 64);
    _tile_dpbf16ps(0, 3, 1);
    if (dk == 4) {
      _tile_loadd(1, kt + 2 * kT * kT, 64);
      _tile_dpbf16ps(0, 4, 1);
      _tile_loadd(1, kt + 3 * kT * kT, 64);
      _tile_dpbf16ps(0, 5, 1);
    }
    _tile_stored(0, scores.data() + pb * kT, lds * 4);
  }
  // Softmax of each query's row over its positions 0..hi[c]; the rest of the row becomes 0. (Lanes
  // past hi[c] are read but masked: later positions' scores or unwritten buffer.)
  float inv[kT];
  for (int64_t c = 0; c < nc; ++c) {
    const float* s = scores.data() + c * lds;
    uint16_t* p = probs.data() + c * ldp;
    const int64_t n = hi[c] + 1;
    auto lanes = [n](int64_t j) { return first_lanes(std::clamp<int64_t>(n - j, 0, 16)); };
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) mv = _mm512_mask_max_ps(mv, lanes(j), mv, _mm512_loadu_ps(s + j));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv)), sc = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j < n; j += 32) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16 * h), mx), sc);
        e[h] = _mm512_maskz_mov_ps(lanes(j + 16 * h), tandem_kernels::exp_clamped16(x));
        sum = _mm512_add_ps(sum, e[h]);
      }
      _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    for (; j < width; j += 32) _mm512_storeu_si512(p + j, _mm512_setzero_si512());
    inv[c] = 1.f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t c = nc; c < kT; ++c) std::fill(probs.begin() + c * ldp, probs.begin() + c * ldp + width, 0);
  // P . V, 4 output tiles (64 head elements) at a time.
  alignas(64) float o[kT * 64];
  for (int64_t d0 = 0; d0 < dv; d0 += 4) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t pb = 0; pb < vblocks; ++pb) {
      const uint32_t* vt = ctx.values.data() + (pb * dv + d0) * kT * kT;
      _tile_loadd(0, probs.data() + pb * 2 * kT, ldp * 2);
      _tile_loadd(1, vt, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(1, vt + kT * kT, 64);
      _tile_dpbf16ps(3, 0, 1);
      _tile_loadd(1, vt + 2 * kT * kT, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, vt + 3 * kT * kT, 64);
      _tile_dpbf16ps(5, 0, 1);
    }
    _tile_stored(2, o, 256);
    _tile_stored(3, o + 16, 256);
    _tile_stored(4, o + 32, 256);
    _tile_stored(5, o + 48, 256);
    for (int64_t c = 0; c < nc; ++c) {
      const __m512 iv = _mm512_set1_ps(inv[c]);
      for (int64_t t = 0; t < 4; ++t) {
        const __m512 r = _mm512_mul_ps(_mm512_load_ps(o + c * 64 + t * 16), iv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orows[c] + (d0 + t) * 16), (__m256i)_mm512_cvtneps_pbh(r));
      }
    }
  }
}

// q [T, H, D], k and v [T, KVH, D], kv_cache [2, blocks, block_size, KVH, D], all bfloat16; the
// layout paged_attention takes (cpu_ops.cpp), checked alike. Returns the output [T, H, D].
at::Tensor paged_attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale_d) {
  const char* op = "tandem paged_attention_amx";
  TORCH_CHECK(amx_ready(), op, ": the OS did not grant AMX to this process");
  at::Tensor out = check_paged(op, q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16, op,
              ": bfloat16 queries and cache only");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int64_t BS = kv_cache.size(2), group = H / KVH, B = seq_lens.numel();
  TORCH_CHECK(D == 64 || D == 128, op, ": head_dim 64 or 128 only, got ", D);
  TORCH_CHECK(kv_cache.size(4) == D, op, ": cache rows must be head_dim values");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  auto* kc = reinterpret_cast<uint16_t*>(kv_cache.data_ptr());
  uint16_t* vc = kc + kv_cache.stride(0);
  auto row_of = [&](int64_t t, const at::Tensor& x, int64_t g) {
    return reinterpret_cast<const uint16_t*>(x.data_ptr()) + t * x.stride(0) + g * x.stride(1);
  };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < KVH; ++g) {
      std::memcpy(kc + (slots[t] * KVH + g) * D, row_of(t, k, g), D * 2);
      std::memcpy(vc + (slots[t] * KVH + g) * D, row_of(t, v, g), D * 2);
    }
  // Each (request, KV head) laid out once, in parallel.
  std::vector<PackedContext> packed(B * KVH);
  at::parallel_for(0, B * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<const uint16_t*> krows, vrows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, g = i % KVH, span = sl[b];
      krows.resize(span);
      vrows.resize(span);
      for (int64_t pos = 0; pos < span; ++pos) {
        const int64_t row = tables[b * max_blocks + pos / BS] * BS + pos % BS;
        krows[pos] = kc + (row * KVH + g) * D;
        vrows[pos] = vc + (row * KVH + g) * D;
      }
      pack_context(krows.data(), vrows.data(), span, D, packed[i]);
    }
  });
  // Tasks: (request, KV head, tile of 16 of its query vectors).
  std::vector<int64_t> task_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b)
    task_start[b + 1] = task_start[b] + KVH * (((qsl[b + 1] - qsl[b]) * group + kT - 1) / kT);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op_ = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float scale = static_cast<float>(scale_d);
  at::parallel_for(0, task_start[B], 1, [&](int64_t task0, int64_t task1) {
    configure_attention_tiles();
    std::vector<float> scores;
    std::vector<uint16_t> probs;
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t b = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
      const int64_t tiles = (task_start[b + 1] - task_start[b]) / KVH, local = task - task_start[b];
      const int64_t g = local / tiles, c0 = (local % tiles) * kT;
      const int64_t nq = qsl[b + 1] - qsl[b], nc = std::min(kT, nq * group - c0);
      const uint16_t* qrows[kT];
      uint16_t* orows[kT];
      int64_t hi[kT];
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t i = (c0 + c) / group, head = g * group + (c0 + c) % group, tok = qsl[b] + i;
        qrows[c] = qp + tok * q.stride(0) + head * q.stride(1);
        orows[c] = op_ + (tok * H + head) * D;
        hi[c] = sl[b] - nq + i;
      }
      attend_tile(qrows, hi, nc, packed[b * KVH + g], D, scale, scores, probs, orows);
    }
    _tile_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "paged_attention_amx(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("paged_attention_amx", &paged_attention_amx); }

#endif  // AMX
