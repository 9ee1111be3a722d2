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
// floats), so no running rescaling is needed. A request with at most kDirectTiles query tiles per
// KV head (decodes, verifications) skips the layout and reads keys and values where they lie in
// the cache (attend_direct): a decode step's attention reads each context once, not three times.

#include <torch/library.h>

#include "exp_approx.h"
#include "kernel_util.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace {

constexpr int64_t kT = 16;  // tile rows and 32-bit columns
// Up to this many query tiles per (request, KV head) read the context from the cache each time
// rather than laying it out once.
constexpr int64_t kDirectTiles = 4;
constexpr float kLog2e = 1.44269504088896341f;

// All six tiles 16 rows of 64 bytes. Scores: 0 = S^T (attend_direct: S), 1 = a key tile, 2-5 = the
// queries' blocks of 32 head elements. Values: 0 = a block of 32 probabilities per query, 1 = a
// value tile, 2-5 = the output's blocks of 16 head elements.
void configure_attention_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.set(t, kT, 64);
  cfg.load();
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

// P . V into output tiles 2-5: tile 0 takes 16 queries' bfloat16 probabilities of 32 positions
// (rows `ld` bytes apart), tile 1 in turn the four value tiles of those positions (1 KB apart).
inline void multiply_values(const void* probs, int64_t ld, const uint32_t* vt) {
  _tile_loadd(0, probs, ld);
  _tile_loadd(1, vt, 64);
  _tile_dpbf16ps(2, 0, 1);
  _tile_loadd(1, vt + kT * kT, 64);
  _tile_dpbf16ps(3, 0, 1);
  _tile_loadd(1, vt + 2 * kT * kT, 64);
  _tile_dpbf16ps(4, 0, 1);
  _tile_loadd(1, vt + 3 * kT * kT, 64);
  _tile_dpbf16ps(5, 0, 1);
}

// Output tiles 2-5 (head elements d0 * 16 onwards) as bfloat16 rows, each query's scaled by its 1 / sum.
inline void store_output(const float* inv, int64_t nc, int64_t d0, uint16_t* const* orows) {
  alignas(64) float o[kT * 64];
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
    // exp((s - max) * scale) = 2^(s * sc - max * sc), sc = scale * log2(e).
    const float sc2 = scale * kLog2e;
    const __m512 sc = _mm512_set1_ps(sc2), msc = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * sc2);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j < n; j += 32) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16 * h), sc, msc);
        e[h] = _mm512_maskz_mov_ps(lanes(j + 16 * h), tandem_kernels::exp2_nonpositive16(t));
        sum = _mm512_add_ps(sum, e[h]);
      }
      _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    for (; j < width; j += 32) _mm512_storeu_si512(p + j, _mm512_setzero_si512());
    inv[c] = 1.f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t c = nc; c < kT; ++c) std::fill(probs.begin() + c * ldp, probs.begin() + c * ldp + width, 0);
  // P . V, 4 output tiles (64 head elements) at a time.
  for (int64_t d0 = 0; d0 < dv; d0 += 4) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t pb = 0; pb < vblocks; ++pb)
      multiply_values(probs.data() + pb * 2 * kT, ldp * 2, ctx.values.data() + (pb * dv + d0) * kT * kT);
    store_output(inv, nc, d0, orows);
  }
}

// A tile of 16 query vectors in the right operand's pair layout: per 32 head elements a tile whose
// row r holds, for each query c, its elements 2r and 2r + 1 (padding queries zero).
void pack_queries(const uint16_t* const* qrows, int64_t nc, int64_t D, uint32_t* out) {
  for (int64_t blk = 0; blk < D / 32; ++blk) {
    __m512i r[16];
    for (int64_t c = 0; c < kT; ++c) r[c] = c < nc ? _mm512_loadu_si512(qrows[c] + blk * 32) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t i = 0; i < kT; ++i) _mm512_store_si512(out + (blk * kT + i) * kT, r[i]);
  }
}

// Where position p of a request's context sits in one head's cache rows (table: its block table).
inline int64_t cache_row(const int64_t* table, int64_t p, int64_t BS, int64_t KVH, int64_t g, int64_t D) {
  return ((table[p / BS] * BS + p % BS) * KVH + g) * D;
}

// One tile of at most 16 query vectors against a context read straight from the paged cache, for
// a request whose queries fill one tile per KV head (decodes, short verifications): laying its
// context out first (pack_context) would cost more than the one tile it serves. Keys are the left
// operand as they lie in the cache (16 positions of a block, one row apart): S = K . Q^T puts a
// position's scores for all queries in one row, so the softmax runs down the positions with a
// query per lane. Values are laid out in pairs of positions 32 at a time in a buffer that stays in
// L1. Needs blocks of a multiple of 16 positions.
void attend_direct(const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t BS, int64_t KVH, int64_t g,
                   int64_t D, const uint16_t* const* qrows, const int64_t* hi, int64_t nc, float scale,
                   std::vector<float>& scores, uint16_t* const* orows) {
  int64_t span = 0;
  for (int64_t c = 0; c < nc; ++c) span = std::max(span, hi[c] + 1);
  const int64_t kblocks = (span + kT - 1) / kT, vblocks = (span + 2 * kT - 1) / (2 * kT);
  const int64_t dk = D / 32, dv = D / 16, ld = KVH * D * 2;  // ld: bytes between positions
  scores.resize(vblocks * 2 * kT * kT);
  float* s = scores.data();
  alignas(64) uint32_t qt[4 * kT * kT];
  pack_queries(qrows, nc, D, qt);
  _tile_loadd(2, qt, 64);
  _tile_loadd(3, qt + kT * kT, 64);
  if (dk == 4) {
    _tile_loadd(4, qt + 2 * kT * kT, 64);
    _tile_loadd(5, qt + 3 * kT * kT, 64);
  }
  for (int64_t pb = 0; pb < kblocks; ++pb) {
    const uint16_t* krow = kc + cache_row(table, pb * kT, BS, KVH, g, D);
    if (pb + 2 < kblocks) {
      const int64_t row = cache_row(table, (pb + 2) * kT, BS, KVH, g, D);
      const char* next = reinterpret_cast<const char*>(kc + row);
      const char* next_v = reinterpret_cast<const char*>(vc + row);
      for (int64_t i = 0; i < kT; ++i)
        for (int64_t b = 0; b < D * 2; b += 64) {
          _mm_prefetch(next + i * ld + b, _MM_HINT_T0);
          _mm_prefetch(next_v + i * ld + b, _MM_HINT_T1);
        }
    }
    _tile_zero(0);
    _tile_loadd(1, krow, ld);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, krow + 32, ld);
    _tile_dpbf16ps(0, 1, 3);
    if (dk == 4) {
      _tile_loadd(1, krow + 64, ld);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(1, krow + 96, ld);
      _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, s + pb * kT * kT, 64);
  }
  // Lane c sees positions 0..hi[c]; padding lanes none. Scores outside are never read unmasked.
  alignas(64) int32_t last[kT];
  for (int64_t c = 0; c < kT; ++c) last[c] = c < nc ? static_cast<int32_t>(hi[c]) : -1;
  const __m512i lastv = _mm512_load_si512(last);
  auto seen = [&](int64_t p) { return _mm512_cmpge_epi32_mask(lastv, _mm512_set1_epi32(static_cast<int32_t>(p))); };
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t p = 0; p < span; ++p) mx = _mm512_mask_max_ps(mx, seen(p), mx, _mm512_loadu_ps(s + p * kT));
  mx = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), _mm512_setzero_ps());
  const __m512 sc = _mm512_set1_ps(scale * kLog2e), msc = _mm512_mul_ps(mx, sc);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t p = 0; p < vblocks * 2 * kT; ++p) {
    const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(s + p * kT), sc, msc);
    const __m512 e = _mm512_maskz_mov_ps(seen(p), tandem_kernels::exp2_nonpositive16(t));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(s + p * kT, e);
  }
  alignas(64) float inv[kT];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
  // P . V, 4 output tiles (64 head elements) at a time; P as bfloat16 rows of 32 positions a query.
  __m512i lo_idx, hi_idx;
  {
    alignas(64) uint16_t lo[32], hi_[32];
    for (int j = 0; j < 32; ++j) {
      lo[j] = static_cast<uint16_t>((j % 2) * 32 + j / 2);
      hi_[j] = static_cast<uint16_t>((j % 2) * 32 + 16 + j / 2);
    }
    lo_idx = _mm512_load_si512(lo);
    hi_idx = _mm512_load_si512(hi_);
  }
  alignas(64) uint16_t pt[kT * 2 * kT];
  alignas(64) uint32_t vt[4 * kT * kT];
  for (int64_t d0 = 0; d0 < dv; d0 += 4) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t pb = 0; pb < vblocks; ++pb) {
      __m512i r[16], r2[16];
      for (int64_t i = 0; i < kT; ++i) {
        r[i] = _mm512_loadu_si512(s + (pb * 2 * kT + i) * kT);
        r2[i] = _mm512_loadu_si512(s + (pb * 2 * kT + kT + i) * kT);
      }
      transpose16(r);
      transpose16(r2);
      for (int64_t c = 0; c < kT; ++c)
        _mm512_store_si512(pt + c * 2 * kT, (__m512i)_mm512_cvtne2ps_pbh((__m512)r2[c], (__m512)r[c]));
      for (int64_t i = 0; i < kT; ++i) {
        const int64_t p0 = pb * 2 * kT + 2 * i;  // p0 and p0 + 1 share a block
        const uint16_t* a = p0 < span ? vc + cache_row(table, p0, BS, KVH, g, D) + d0 * 16 : nullptr;
        for (int64_t h = 0; h < 2; ++h) {  // 32 head elements: two value tiles
          const __m512i x = a ? _mm512_loadu_si512(a + h * 32) : _mm512_setzero_si512();
          const __m512i y = a && p0 + 1 < span ? _mm512_loadu_si512(a + KVH * D + h * 32) : _mm512_setzero_si512();
          _mm512_store_si512(vt + ((2 * h) * kT + i) * kT, _mm512_permutex2var_epi16(x, lo_idx, y));
          _mm512_store_si512(vt + ((2 * h + 1) * kT + i) * kT, _mm512_permutex2var_epi16(x, hi_idx, y));
        }
      }
      multiply_values(pt, 64, vt);
    }
    store_output(inv, nc, d0, orows);
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
  // Requests with one query tile per KV head read the cache directly; the others' contexts are
  // laid out once per (request, KV head), in parallel.
  const bool blocks_fit = BS % kT == 0;
  auto direct = [&](int64_t b) { return blocks_fit && (qsl[b + 1] - qsl[b]) * group <= kDirectTiles * kT; };
  std::vector<PackedContext> packed(B * KVH);
  at::parallel_for(0, B * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<const uint16_t*> krows, vrows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, g = i % KVH, span = sl[b];
      if (direct(b)) continue;
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
      if (direct(b))
        attend_direct(kc, vc, tables + b * max_blocks, BS, KVH, g, D, qrows, hi, nc, scale, scores, orows);
      else
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
