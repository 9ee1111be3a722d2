// Products of a decode step's rows (1 to about 64) with weights laid out in AMX tiles, bfloat16 or
// int8, on CPUs with AMX (Sapphire Rapids and later).
//
// A step of that size is bound by reading the weight once from memory. oneDNN's packed bfloat16
// GEMM streams it at ~17-20 GB/s at 32-64 rows on the 2-core Sapphire Rapids VM and its int8 GEMM
// at ~10; these kernels read each weight panel once, in the order it is stored, prefetched ahead,
// and reach ~20-28 GB/s up to 32 rows (benchmarks/gemm_paths.py). Above ~64 rows a product is
// bound by compute: in bfloat16 oneDNN's blocking ties or wins there, so bfloat16 layers keep its
// form for prompt chunks (tandem/model/linear.py); in int8 these kernels stay ahead (1.6x oneDNN's
// int8 GEMM at 512 rows) and take every product (tandem/model/quant.py).
//
// Layout (`amx_pack`): output columns in panels of 32 (two 16-column B tiles), then K in blocks of
// 64 bytes (32 bfloat16 or 64 int8 values), each tile 16 rows of 64 bytes: row r holds, for each of
// the 16 columns, the 4 bytes of K it covers at that row (a pair of bfloat16, four int8), which is
// the VNNI order the tile instructions take. A panel is contiguous, so each thread streams one range
// of memory. Padding (columns to 32, K to a whole block) is zero.

#include <torch/library.h>

#include "kernel_util.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
namespace {

constexpr int64_t kPanelCols = 32;
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileBytes = 1024;
constexpr int64_t kBlockBytes = 64;  // bytes of K per tile row
// How far ahead of the tile being multiplied the weight stream is prefetched: without it the tile
// loads wait on memory between products (32 rows: ~22 -> ~25 GB/s).
constexpr int64_t kPrefetchBytes = 4096;
// Activation bytes one pass over the weight's panels multiplies: half the L2 of a Sapphire Rapids
// core (2 MB), the rest for the panels.
constexpr int64_t kRowBlockBytes = 1 << 20;

// Tiles 0-3: results (row block r, column tile c at 2r + c); 4, 5: activation row blocks; 6, 7: the
// weight's two column tiles. r1 = 0: one row block.
void configure_tiles(int r0, int r1) {
  TileConfig cfg;
  auto set = [&](int tile, int rows) { cfg.set(tile, rows, kBlockBytes); };
  for (int t : {0, 1, 4}) set(t, r0);
  if (r1 > 0)
    for (int t : {2, 3, 5}) set(t, r1);
  set(6, kTileRows);
  set(7, kTileRows);
  cfg.load();
}

struct Bf16Tiles {
  using Acc = float;
  static constexpr int64_t kValuesPerBlock = 32;
  // The intrinsics name their tiles in assembler text: literal tile numbers only.
  static void dot_row_block0() {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  static void dot_row_block1() {
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
};

struct Int8Tiles {  // unsigned activations (offset by 128) times signed weights
  using Acc = int32_t;
  static constexpr int64_t kValuesPerBlock = 64;
  static void dot_row_block0() {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
  }
  static void dot_row_block1() {
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
};

// tile_product (below) over rows a block of activations small enough to stay in L2.
template <class T, class Epi>
void tile_product_rows(const char* a, int64_t lda, int64_t M, int64_t kblocks, const char* w, int64_t N,
                       const Epi& epi) {
  const int64_t panels = (N + kPanelCols - 1) / kPanelCols;
  const int64_t panel_bytes = kblocks * 2 * kTileBytes;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) typename T::Acc acc[kTileRows * kTileRows];
    int cur0 = -1, cur1 = -1;
    for (int64_t p = p0; p < p1; ++p) {
      const char* wp = w + p * panel_bytes;
      const int64_t n0 = p * kPanelCols;
      const int c0 = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
      const int c1 = static_cast<int>(std::clamp<int64_t>(N - n0 - kTileRows, 0, kTileRows));
      // Rows in blocks of 32: the panel comes from memory for the first and from L2 for the rest.
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(2 * kTileRows, M - m0));
        const int r0 = std::min<int>(rows, kTileRows), r1 = rows - r0;
        if (r0 != cur0 || r1 != cur1) {
          configure_tiles(r0, r1);
          cur0 = r0;
          cur1 = r1;
        }
        _tile_zero(0);
        _tile_zero(1);
        if (r1) {
          _tile_zero(2);
          _tile_zero(3);
        }
        const char* a0 = a + m0 * lda;
        const char* a1 = a0 + kTileRows * lda;
        for (int64_t b = 0; b < kblocks; ++b) {
          const char* wt = wp + b * 2 * kTileBytes;
          if (m0 == 0)
            for (int64_t i = 0; i < 2 * kTileBytes; i += 64) _mm_prefetch(wt + kPrefetchBytes + i, _MM_HINT_T0);
          _tile_loadd(6, wt, kBlockBytes);
          _tile_loadd(7, wt + kTileBytes, kBlockBytes);
          _tile_loadd(4, a0 + b * kBlockBytes, lda);
          T::dot_row_block0();
          if (r1) {
            _tile_loadd(5, a1 + b * kBlockBytes, lda);
            T::dot_row_block1();
          }
        }
        _tile_stored(0, acc, kBlockBytes);
        epi(m0, n0, r0, c0, acc);
        if (c1) {
          _tile_stored(1, acc, kBlockBytes);
          epi(m0, n0 + kTileRows, r0, c1, acc);
        }
        if (r1) {
          _tile_stored(2, acc, kBlockBytes);
          epi(m0 + kTileRows, n0, r1, c0, acc);
          if (c1) {
            _tile_stored(3, acc, kBlockBytes);
            epi(m0 + kTileRows, n0 + kTileRows, r1, c1, acc);
          }
        }
      }
    }
    _tile_release();
  });
}

// a: M rows of `kblocks` * 64 bytes at a stride of lda bytes; w: amx_pack's layout for N columns.
// epi(m0, n0, rows, cols, acc) takes each finished 16 x 16 result tile (row stride 16). Every panel
// of the weight multiplies all rows of a row block before the next panel: a block's activations
// stay in L2 (a prompt chunk's rows of a wide layer would not), each panel streams from memory once
// per block.
template <class T, class Epi>
void tile_product(const char* a, int64_t lda, int64_t M, int64_t kblocks, const char* w, int64_t N, const Epi& epi) {
  const int64_t block = std::max<int64_t>(2 * kTileRows, kRowBlockBytes / lda / (2 * kTileRows) * (2 * kTileRows));
  for (int64_t mb = 0; mb < M; mb += block) {
    tile_product_rows<T>(a + mb * lda, lda, std::min(block, M - mb), kblocks, w, N,
                         [&](int64_t m0, int64_t n0, int rows, int cols, const typename T::Acc* acc) {
                           epi(mb + m0, n0, rows, cols, acc);
                         });
  }
}

// Stores 16 float32 lanes (the first `cols`) as bfloat16, rounded to nearest even.
inline void store_bf16(uint16_t* dst, __m512 v, int cols) {
  _mm256_mask_storeu_epi16(dst, first_lanes(cols), (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 load_bias(const float* bias, int64_t n0, int cols) {
  return bias ? _mm512_maskz_loadu_ps(first_lanes(cols), bias + n0) : _mm512_setzero_ps();
}

// quantize_row_u8 (kernel_util.h) on 16 lanes, reading float32 or bfloat16 directly: the same
// operations (max |x| / 127, x times its reciprocal rounded to nearest even, clamped, + 128), so the
// same bytes (a scalar loop costs about a third of a 32-row int8 product).
template <typename T>
float quantize_row_u8_16(const T* row, int64_t K, uint8_t* out) {
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

int64_t padded_k(int64_t K, int64_t values_per_block) {
  return (K + values_per_block - 1) / values_per_block * values_per_block;
}

void check_packed(const char* op, const at::Tensor& packed, at::ScalarType dtype, int64_t N, int64_t K,
                  int64_t values_per_block) {
  TORCH_CHECK(packed.scalar_type() == dtype && packed.is_contiguous() && packed.dim() == 5, op,
              ": packed must come from amx_pack");
  TORCH_CHECK(packed.size(0) == (N + kPanelCols - 1) / kPanelCols &&
                  packed.size(1) == padded_k(K, values_per_block) / values_per_block,
              op, ": packed holds a different shape than x's columns and n");
}

// w [N, K] bfloat16 or int8 -> amx_pack's layout (see the top of this file).
at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kChar),
              "tandem amx_pack: w must be a 2-D bfloat16 or int8 matrix");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t group = 4 / static_cast<int64_t>(w.element_size());  // values per 4 bytes
  const int64_t per_block = kTileRows * group;
  const int64_t Np = (N + kPanelCols - 1) / kPanelCols * kPanelCols, Kp = padded_k(K, per_block);
  at::Tensor padded = at::zeros({Np, Kp}, w.options());
  padded.slice(0, 0, N).slice(1, 0, K).copy_(w);
  // [panel, tile, column, block, row, value] -> [panel, block, tile, row, column, value]
  return padded.view({Np / kPanelCols, 2, kTileRows, Kp / per_block, kTileRows, group})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous()
      .view({Np / kPanelCols, Kp / per_block, 2, kTileRows, kTileRows * group});
}

// x [M, K] bfloat16 times the bfloat16 weight amx_pack laid out ([N, K] before), plus bias; float32
// accumulation, the result bfloat16.
at::Tensor gemm_amx_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "tandem gemm_amx_bf16: the OS did not grant AMX to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "tandem gemm_amx_bf16: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), Kp = padded_k(K, Bf16Tiles::kValuesPerBlock);
  check_packed("tandem gemm_amx_bf16", packed, at::kBFloat16, n, K, Bf16Tiles::kValuesPerBlock);
  // Tile rows are read whole: a K that is not a multiple of 32 is read from a zero-padded copy.
  at::Tensor xa = Kp == K ? x.contiguous() : at::constant_pad_nd(x, {0, Kp - K});
  at::Tensor b;
  const float* bp = bias_ptr(bias, n, b);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto epi = [&](int64_t m0, int64_t n0, int rows, int cols, const float* acc) {
    const __m512 bv = load_bias(bp, n0, cols);
    for (int r = 0; r < rows; ++r)
      store_bf16(op + (m0 + r) * n + n0, _mm512_add_ps(_mm512_load_ps(acc + r * kTileRows), bv), cols);
  };
  const auto* xp = reinterpret_cast<const uint16_t*>(xa.data_ptr());
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr());
  const int64_t kblocks = Kp / Bf16Tiles::kValuesPerBlock;
  tile_product<Bf16Tiles>(reinterpret_cast<const char*>(xp), Kp * 2, M, kblocks, wp, n, epi);
  return out;
}

// Dynamic int8 activations (one symmetric scale per row) times the int8 weight amx_pack laid out,
// with one scale per output column: y = x_scale * w_scale * sum(xq * w) + bias, in x's dtype
// (float32 or bfloat16). The tile product wants unsigned activations: they are offset by 128, and
// 128 * sum(w) (`w_sum`) taken back out.
at::Tensor gemm_amx_w8a8(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& w_scale,
                         const at::Tensor& w_sum, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "tandem gemm_amx_w8a8: the OS did not grant AMX to this process");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "tandem gemm_amx_w8a8: x must be 2-D float32 or bfloat16");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == n,
              "tandem gemm_amx_w8a8: w_scale must be contiguous float32, one per output column");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == n,
              "tandem gemm_amx_w8a8: w_sum must be contiguous int32, one per output column");
  const int64_t M = x.size(0), K = x.size(1), Kp = padded_k(K, Int8Tiles::kValuesPerBlock);
  check_packed("tandem gemm_amx_w8a8", packed, at::kChar, n, K, Int8Tiles::kValuesPerBlock);
  if (M == 0) return at::empty({0, n}, x.options());
  const at::Tensor xc = x.contiguous();
  // Padding columns hold any value: the weight there is zero.
  at::Tensor xu = at::empty({M, Kp}, x.options().dtype(at::kByte));
  at::Tensor xs = at::empty({M}, x.options().dtype(at::kFloat));
  uint8_t* up = xu.data_ptr<uint8_t>();
  float* sp = xs.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      if (xc.scalar_type() == at::kFloat)
        sp[m] = quantize_row_u8_16(xc.data_ptr<float>() + m * K, K, up + m * Kp);
      else
        sp[m] = quantize_row_u8_16(reinterpret_cast<const uint16_t*>(xc.data_ptr()) + m * K, K, up + m * Kp);
    }
  });
  at::Tensor b;
  const float* bp = bias_ptr(bias, n, b);
  const float* ws = w_scale.data_ptr<float>();
  const int32_t* wsum = w_sum.data_ptr<int32_t>();
  at::Tensor out = at::empty({M, n}, x.options());
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  tile_product<Int8Tiles>(
      reinterpret_cast<const char*>(up), Kp, M, Kp / Int8Tiles::kValuesPerBlock,
      reinterpret_cast<const char*>(packed.data_ptr()), n,
      [&](int64_t m0, int64_t n0, int rows, int cols, const int32_t* acc) {
        const __mmask16 lanes = first_lanes(cols);
        const __m512 bv = load_bias(bp, n0, cols);
        const __m512 wsv = _mm512_maskz_loadu_ps(lanes, ws + n0);
        const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(lanes, wsum + n0), 7);  // 128 * sum
        for (int r = 0; r < rows; ++r) {
          const __m512i dot = _mm512_sub_epi32(_mm512_load_si512(acc + r * kTileRows), offset);
          const __m512 scale = _mm512_mul_ps(wsv, _mm512_set1_ps(sp[m0 + r]));
          const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, bv);
          if (of)
            _mm512_mask_storeu_ps(of + (m0 + r) * n + n0, lanes, v);
          else
            store_bf16(ob + (m0 + r) * n + n0, v, cols);
        }
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("gemm_amx_bf16(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("gemm_amx_w8a8(Tensor x, Tensor packed, int n, Tensor w_scale, Tensor w_sum, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("gemm_amx_bf16", &gemm_amx_bf16);
  m.impl("gemm_amx_w8a8", &gemm_amx_w8a8);
}

#endif  // AMX
