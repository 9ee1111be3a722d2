// Products of a decode step's rows (1 to about 64) with weights laid out in AMX tiles, bfloat16 or
// int8, on CPUs with AMX (Sapphire Rapids and later).
//
// A step of that size is bound by reading the weight once from memory. oneDNN's packed bfloat16
// GEMM streams it at ~17-20 GB/s at 32-64 rows on the 2-core Sapphire Rapids VM and its int8 GEMM
// at ~10; these kernels read each weight panel once, in the order it is stored, prefetched ahead,
// and reach ~20-28 GB/s up to 32 rows (benchmarks/gemm_paths.py). Above ~64 rows a product is
// bound by compute: in bfloat16 oneDNN's blocking ties or wins there, so bfloat16 layers keep its
// form for prompt chunks (tandem/model/linear.py); in int8 these kernels stay ahead (1.6x oneDNN's
// int8 GEMM at 512 rows) and take every product (tandem/model/quant.py). A gated MLP's gate/up
// product can end in SiLU-and-multiply instead of writing both halves (`*_silu_mul`: the weight's
// rows interleaved 16 at a time so that each panel pairs 16 gate and 16 up columns;
// tandem/model/gate_up.py).
//
// Layout (`amx_pack`): output columns in panels of 32 (two 16-column B tiles), then K in blocks of
// 64 bytes (32 bfloat16 or 64 int8 values), each tile 16 rows of 64 bytes: row r holds, for each of
// the 16 columns, the 4 bytes of K it covers at that row (a pair of bfloat16, four int8), which is
// the VNNI order the tile instructions take. A panel is contiguous, so each thread streams one range
// of memory. Padding (columns to 32, K to a whole block) is zero.

#include <torch/library.h>

#include "exp_approx.h"
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

// A weight stored in amx_pack's layout: each thread reads its panels where they lie, streamed from
// memory (prefetched ahead of the tile loads).
struct PackedPanels {
  static constexpr bool kStreamed = true;
  const char* w;
  int64_t panel_bytes;
  struct Reader {
    const PackedPanels& src;
    const char* operator()(int64_t p) { return src.w + p * src.panel_bytes; }
  };
  Reader reader() const { return {*this}; }
};

// tile_product (below) over rows a block of activations small enough to stay in L2. `src.reader()`
// (one per thread) gives each panel's tiles in amx_pack's layout.
template <class T, class Src, class Epi>
void tile_product_rows(const char* a, int64_t lda, int64_t M, int64_t kblocks, const Src& src, int64_t N,
                       const Epi& epi) {
  const int64_t panels = (N + kPanelCols - 1) / kPanelCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    // For the epilogues' float arithmetic (the tile products themselves flush denormals always):
    // SiLU's reciprocal is denormal for inputs below about -87, and each denormal costs an assist.
    tandem_kernels::FlushDenormals flush;
    alignas(64) typename T::Acc acc[kTileRows * kPanelCols];
    auto panel = src.reader();
    int cur0 = -1, cur1 = -1;
    for (int64_t p = p0; p < p1; ++p) {
      const char* wp = panel(p);
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
          if (Src::kStreamed && m0 == 0)
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
        constexpr int64_t kAccRowBytes = kPanelCols * 4;
        _tile_stored(0, acc, kAccRowBytes);
        if (c1) _tile_stored(1, acc + kTileRows, kAccRowBytes);
        epi(m0, n0, r0, c0 + c1, acc);
        if (r1) {
          _tile_stored(2, acc, kAccRowBytes);
          if (c1) _tile_stored(3, acc + kTileRows, kAccRowBytes);
          epi(m0 + kTileRows, n0, r1, c0 + c1, acc);
        }
      }
    }
    _tile_release();
  });
}

// a: M rows of `kblocks` * 64 bytes at a stride of lda bytes; src: the weight's panels for N
// columns (`PackedPanels`: amx_pack's layout in memory; `Int4Panels`: made from 4-bit groups).
// epi(m0, n0, rows, cols, acc) takes each panel's finished result for up to 16 rows: `rows` rows of
// kPanelCols values (row stride kPanelCols), the panel's two column tiles side by side, of which
// the first `cols` are real columns. Every panel
// of the weight multiplies all rows of a row block before the next panel: a block's activations
// stay in L2 (a prompt chunk's rows of a wide layer would not), each panel streams from memory once
// per block.
template <class T, class Src, class Epi>
void tile_product_from(const char* a, int64_t lda, int64_t M, int64_t kblocks, const Src& src, int64_t N,
                       const Epi& epi) {
  const int64_t block = std::max<int64_t>(2 * kTileRows, kRowBlockBytes / lda / (2 * kTileRows) * (2 * kTileRows));
  for (int64_t mb = 0; mb < M; mb += block) {
    tile_product_rows<T>(a + mb * lda, lda, std::min(block, M - mb), kblocks, src, N,
                         [&](int64_t m0, int64_t n0, int rows, int cols, const typename T::Acc* acc) {
                           epi(mb + m0, n0, rows, cols, acc);
                         });
  }
}

// w: amx_pack's layout for N columns.
template <class T, class Epi>
void tile_product(const char* a, int64_t lda, int64_t M, int64_t kblocks, const char* w, int64_t N, const Epi& epi) {
  tile_product_from<T>(a, lda, M, kblocks, PackedPanels{w, kblocks * 2 * kTileBytes}, N, epi);
}

// Stores 16 float32 lanes (the first `cols`) as bfloat16, rounded to nearest even.
inline void store_bf16(uint16_t* dst, __m512 v, int cols) {
  _mm256_mask_storeu_epi16(dst, first_lanes(cols), (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 load_bias(const float* bias, int64_t n0, int cols) {
  return bias ? _mm512_maskz_loadu_ps(first_lanes(cols), bias + n0) : _mm512_setzero_ps();
}

// The epilogue of a bfloat16 product into out [M, n] (row stride n): each panel's float32 sums
// plus the bias (nullptr: none), rounded to bfloat16.
inline auto bf16_epilogue(uint16_t* out, int64_t n, const float* bias) {
  return [=](int64_t m0, int64_t n0, int rows, int cols, const float* acc) {
    for (int h = 0; h * kTileRows < cols; ++h) {
      const int c = std::min<int>(kTileRows, cols - h * kTileRows);
      const __m512 bv = load_bias(bias, n0 + h * kTileRows, c);
      for (int r = 0; r < rows; ++r)
        store_bf16(out + (m0 + r) * n + n0 + h * kTileRows,
                   _mm512_add_ps(_mm512_load_ps(acc + r * kPanelCols + h * kTileRows), bv), c);
    }
  };
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

// x [M, K] bfloat16, its columns zero-padded to the tile blocks' Kp where K is not a multiple.
at::Tensor padded_rows(const at::Tensor& x, int64_t Kp) {
  // Tile rows are read whole: a K that is not a multiple of 32 is read from a zero-padded copy.
  return Kp == x.size(1) ? x.contiguous() : at::constant_pad_nd(x, {0, Kp - x.size(1)});
}

void check_bf16_input(const char* op, const at::Tensor& x) {
  TORCH_CHECK(amx_ready(), op, ": the OS did not grant AMX to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be 2-D bfloat16");
}

// 16 float32 lanes rounded to bfloat16 (nearest even) and back: the value a bfloat16 tensor holds.
inline __m512 as_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// A gate/up product's intermediate width, checked against the weight's rows (2 * intermediate).
void check_gate_up(const char* op, int64_t intermediate) {
  TORCH_CHECK(intermediate > 0 && intermediate % kTileRows == 0, op,
              ": intermediate must be a positive multiple of 16 (whole column tiles of gate and up)");
}

// x [M, K] bfloat16 times the bfloat16 weight amx_pack laid out ([N, K] before), plus bias; float32
// accumulation, the result bfloat16.
at::Tensor gemm_amx_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  const char* op_name = "tandem gemm_amx_bf16";
  check_bf16_input(op_name, x);
  const int64_t M = x.size(0), K = x.size(1), Kp = padded_k(K, Bf16Tiles::kValuesPerBlock);
  check_packed(op_name, packed, at::kBFloat16, n, K, Bf16Tiles::kValuesPerBlock);
  const at::Tensor xa = padded_rows(x, Kp);
  at::Tensor b;
  const float* bp = bias_ptr(bias, n, b);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  const auto epi = bf16_epilogue(reinterpret_cast<uint16_t*>(out.data_ptr()), n, bp);
  tile_product<Bf16Tiles>(reinterpret_cast<const char*>(xa.data_ptr()), Kp * 2, M, Kp / Bf16Tiles::kValuesPerBlock,
                          reinterpret_cast<const char*>(packed.data_ptr()), n, epi);
  return out;
}

// silu(x . gate^T) * (x . up^T) [M, I] in one pass, for a weight whose 2 * I rows were interleaved
// 16 at a time before amx_pack (gate 0-15, up 0-15, gate 16-31, ...: tandem/model/gate_up.py): each
// panel's two column tiles are then 16 gate columns and the same 16 up columns, and the epilogue
// writes the activation instead of the [M, 2I] product. The same roundings as gemm_amx_bf16 then
// silu_mul (gate and up to bfloat16, silu to bfloat16, the product to bfloat16): the same bits.
at::Tensor gemm_amx_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  const char* op_name = "tandem gemm_amx_bf16_silu_mul";
  check_bf16_input(op_name, x);
  check_gate_up(op_name, intermediate);
  const int64_t M = x.size(0), K = x.size(1), Kp = padded_k(K, Bf16Tiles::kValuesPerBlock), n = 2 * intermediate;
  check_packed(op_name, packed, at::kBFloat16, n, K, Bf16Tiles::kValuesPerBlock);
  const at::Tensor xa = padded_rows(x, Kp);
  at::Tensor out = at::empty({M, intermediate}, x.options());
  if (M == 0) return out;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto epi = [&](int64_t m0, int64_t n0, int rows, int, const float* acc) {
    uint16_t* o = op + m0 * intermediate + n0 / 2;
    for (int r = 0; r < rows; ++r) {
      const float* a = acc + r * kPanelCols;
      const __m512 s = as_bf16(tandem_kernels::silu16(as_bf16(_mm512_load_ps(a))));
      store_bf16(o + r * intermediate, _mm512_mul_ps(s, as_bf16(_mm512_load_ps(a + kTileRows))), kTileRows);
    }
  };
  tile_product<Bf16Tiles>(reinterpret_cast<const char*>(xa.data_ptr()), Kp * 2, M, Kp / Bf16Tiles::kValuesPerBlock,
                          reinterpret_cast<const char*>(packed.data_ptr()), n, epi);
  return out;
}

// What an int8 tile product reads besides the weight: x's rows quantized ([M, Kp] bytes offset by
// 128; padding columns hold any value, the weight there is zero) with one float32 scale per row,
// and the per-column weight scales, sums and bias.
struct W8A8Inputs {
  at::Tensor rows, row_scales, bias_holder;
  const float* row_scale;
  const float* bias;
  const float* w_scale;
  const int32_t* w_sum;
};

W8A8Inputs prepare_w8a8(const at::Tensor& x, int64_t Kp, int64_t n, const at::Tensor& w_scale,
                        const at::Tensor& w_sum, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0);
  const at::Tensor xc = x.contiguous();
  W8A8Inputs in;
  in.rows = at::empty({M, Kp}, x.options().dtype(at::kByte));
  in.row_scales = at::empty({M}, x.options().dtype(at::kFloat));
  uint8_t* up = in.rows.data_ptr<uint8_t>();
  float* sp = in.row_scales.data_ptr<float>();
  quantize_rows_u8_16(xc, up, Kp, sp);
  in.row_scale = sp;
  in.bias = bias_ptr(bias, n, in.bias_holder);
  in.w_scale = w_scale.data_ptr<float>();
  in.w_sum = w_sum.data_ptr<int32_t>();
  return in;
}

// 16 output columns' dequantization: x_scale * w_scale * (dot - 128 * w_sum) + bias.
class W8A8Columns {
 public:
  W8A8Columns(const W8A8Inputs& in, int64_t n0, int cols)
      : wscale_(_mm512_maskz_loadu_ps(first_lanes(cols), in.w_scale + n0)),
        offset_(_mm512_slli_epi32(_mm512_maskz_loadu_epi32(first_lanes(cols), in.w_sum + n0), 7)),
        bias_(load_bias(in.bias, n0, cols)) {}
  __m512 operator()(const int32_t* dot, float row_scale) const {
    const __m512i d = _mm512_sub_epi32(_mm512_load_si512(dot), offset_);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(wscale_, _mm512_set1_ps(row_scale)), bias_);
  }

 private:
  __m512 wscale_;
  __m512i offset_;
  __m512 bias_;
};

void check_w8a8_args(const char* op, const at::Tensor& x, int64_t n, const at::Tensor& w_scale,
                     const at::Tensor& w_sum) {
  TORCH_CHECK(amx_ready(), op, ": the OS did not grant AMX to this process");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": x must be 2-D float32 or bfloat16");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == n, op,
              ": w_scale must be contiguous float32, one per output column");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == n, op,
              ": w_sum must be contiguous int32, one per output column");
}

// Dynamic int8 activations (one symmetric scale per row) times the int8 weight amx_pack laid out,
// with one scale per output column: y = x_scale * w_scale * sum(xq * w) + bias, in x's dtype
// (float32 or bfloat16). The tile product wants unsigned activations: they are offset by 128, and
// 128 * sum(w) (`w_sum`) taken back out.
at::Tensor gemm_amx_w8a8(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& w_scale,
                         const at::Tensor& w_sum, const std::optional<at::Tensor>& bias) {
  const char* op_name = "tandem gemm_amx_w8a8";
  check_w8a8_args(op_name, x, n, w_scale, w_sum);
  const int64_t M = x.size(0), K = x.size(1), Kp = padded_k(K, Int8Tiles::kValuesPerBlock);
  check_packed(op_name, packed, at::kChar, n, K, Int8Tiles::kValuesPerBlock);
  if (M == 0) return at::empty({0, n}, x.options());
  const W8A8Inputs in = prepare_w8a8(x, Kp, n, w_scale, w_sum, bias);
  at::Tensor out = at::empty({M, n}, x.options());
  float* of = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = of ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  tile_product<Int8Tiles>(
      reinterpret_cast<const char*>(in.rows.data_ptr()), Kp, M, Kp / Int8Tiles::kValuesPerBlock,
      reinterpret_cast<const char*>(packed.data_ptr()), n,
      [&](int64_t m0, int64_t n0, int rows, int cols, const int32_t* acc) {
        for (int h = 0; h * kTileRows < cols; ++h) {
          const int c = std::min<int>(kTileRows, cols - h * kTileRows);
          const int64_t col = n0 + h * kTileRows;
          const W8A8Columns dequant(in, col, c);
          for (int r = 0; r < rows; ++r) {
            const __m512 v = dequant(acc + r * kPanelCols + h * kTileRows, in.row_scale[m0 + r]);
            if (of)
              _mm512_mask_storeu_ps(of + (m0 + r) * n + col, first_lanes(c), v);
            else
              store_bf16(ob + (m0 + r) * n + col, v, c);
          }
        }
      });
  return out;
}

// gemm_amx_w8a8 on a gate/up weight interleaved as for gemm_amx_bf16_silu_mul (w_scale, w_sum and
// bias in that interleaved order): silu(gate) * up [M, I] in x's dtype, rounded as gemm_amx_w8a8
// then silu_mul would round it.
at::Tensor gemm_amx_w8a8_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                                  const at::Tensor& w_scale, const at::Tensor& w_sum,
                                  const std::optional<at::Tensor>& bias) {
  const char* op_name = "tandem gemm_amx_w8a8_silu_mul";
  check_gate_up(op_name, intermediate);
  const int64_t n = 2 * intermediate;
  check_w8a8_args(op_name, x, n, w_scale, w_sum);
  const int64_t M = x.size(0), K = x.size(1), Kp = padded_k(K, Int8Tiles::kValuesPerBlock);
  check_packed(op_name, packed, at::kChar, n, K, Int8Tiles::kValuesPerBlock);
  at::Tensor out = at::empty({M, intermediate}, x.options());
  if (M == 0) return out;
  const W8A8Inputs in = prepare_w8a8(x, Kp, n, w_scale, w_sum, bias);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  auto round = [bf16](__m512 v) { return bf16 ? as_bf16(v) : v; };
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  auto* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  tile_product<Int8Tiles>(
      reinterpret_cast<const char*>(in.rows.data_ptr()), Kp, M, Kp / Int8Tiles::kValuesPerBlock,
      reinterpret_cast<const char*>(packed.data_ptr()), n,
      [&](int64_t m0, int64_t n0, int rows, int, const int32_t* acc) {
            const W8A8Columns gate(in, n0, kTileRows), up(in, n0 + kTileRows, kTileRows);
        const int64_t j0 = n0 / 2;
        for (int r = 0; r < rows; ++r) {
          const int32_t* a = acc + r * kPanelCols;
          const float row_scale = in.row_scale[m0 + r];
          const __m512 s = round(tandem_kernels::silu16(round(gate(a, row_scale))));
          const __m512 v = _mm512_mul_ps(s, round(up(a + kTileRows, row_scale)));
          if (bf16)
            store_bf16(ob + (m0 + r) * intermediate + j0, v, kTileRows);
          else
            _mm512_storeu_ps(of + (m0 + r) * intermediate + j0, v);
        }
      });
  return out;
}

// -- 4-bit weights (tandem/model/int4.py's layout) ---------------------------------------------
//
// Products of more rows than the 4-bit kernel takes (speculative verification, batches of a dozen
// streams and more, prompt chunks) used to dequantize the whole weight to bfloat16 in memory and
// then multiply: per layer, a write and a read of twice the weight's bfloat16 bytes, which for a
// verification step of 17-128 rows cost more than the product. Here each thread dequantizes one
// panel of 32 columns at a time into amx_pack's layout in a buffer that stays in L1/L2, and
// multiplies every row of the block with it: the 4-bit weight is read once, nothing is written.

// The 4-bit weight's panels, each dequantized when a thread reaches it (bfloat16, rounded to
// nearest even as tandem.dequant_int4 rounds: the same weight values as that path multiplies).
struct Int4Panels {
  static constexpr bool kStreamed = false;
  const uint8_t* qw;
  const float* scales;
  const float* zs;  // nullptr: symmetric, zero 8
  int64_t N, K, gs;
  struct Reader {
    const Int4Panels& src;
    std::vector<__m512i> buf;  // one panel: K / 32 blocks of two 1 KiB tiles (64-byte aligned)
    explicit Reader(const Int4Panels& s) : src(s), buf(s.K / 32 * 2 * kTileBytes / 64) {}
    const char* operator()(int64_t p) {
      const int64_t K = src.K, G = K / src.gs, blocks = K / 32;
      char* out = reinterpret_cast<char*>(buf.data());
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t n0 = p * kPanelCols + t * kTileRows;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t g = b * 32 / src.gs;
          __m512i col[16];
          for (int64_t c = 0; c < kTileRows; ++c) {
            const int64_t n = n0 + c;
            if (n >= src.N) {
              col[c] = _mm512_setzero_si512();
              continue;
            }
            const float s = src.scales[n * G + g], z = src.zs ? src.zs[n * G + g] : kSymZero * s;
            __m512 lo, hi;
            int4_block_f32(src.qw + n * (K / 2) + b * 16, _mm512_set1_ps(s), _mm512_set1_ps(z), lo, hi);
            col[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lane j: elements 2j, 2j + 1
          }
          transpose16(col);  // col[r]: K pair r of the 16 columns, a tile row
          char* tile = out + (b * 2 + t) * kTileBytes;
          for (int r = 0; r < kTileRows; ++r) _mm512_store_si512(tile + r * kBlockBytes, col[r]);
        }
      }
      return out;
    }
  };
  Reader reader() const { return Reader(*this); }
};

// x [M, K] bfloat16 times the 4-bit weight [N, K] (qweight [N, K/2], scales and zs [N, K / gs]
// float32, zs absent for a symmetric weight), plus bias; float32 accumulation, bfloat16 result.
at::Tensor gemm_amx_int4(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                         const std::optional<at::Tensor>& zs, int64_t group_size,
                         const std::optional<at::Tensor>& bias) {
  const char* op_name = "tandem gemm_amx_int4";
  check_bf16_input(op_name, x);
  const float* zp = check_int4(op_name, qw, scales, zs, group_size);
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0), gs = group_size;
  TORCH_CHECK(K == qw.size(1) * 2, op_name, ": x has ", K, " columns, the weight ", qw.size(1) * 2);
  const at::Tensor xa = x.contiguous();
  at::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto epi = bf16_epilogue(reinterpret_cast<uint16_t*>(out.data_ptr()), N, bp);
  const Int4Panels src{qw.data_ptr<uint8_t>(), scales.data_ptr<float>(), zp, N, K, gs};
  tile_product_from<Bf16Tiles>(reinterpret_cast<const char*>(xa.data_ptr()), K * 2, M, K / 32, src, N, epi);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("gemm_amx_int4(Tensor x, Tensor qweight, Tensor scales, Tensor? zs, int group_size, Tensor? bias) -> Tensor");
  m.def("gemm_amx_bf16(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("gemm_amx_w8a8(Tensor x, Tensor packed, int n, Tensor w_scale, Tensor w_sum, Tensor? bias) -> Tensor");
  m.def("gemm_amx_bf16_silu_mul(Tensor x, Tensor packed, int intermediate) -> Tensor");
  m.def(
      "gemm_amx_w8a8_silu_mul(Tensor x, Tensor packed, int intermediate, Tensor w_scale, Tensor w_sum, "
      "Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("gemm_amx_int4", &gemm_amx_int4);
  m.impl("gemm_amx_bf16", &gemm_amx_bf16);
  m.impl("gemm_amx_w8a8", &gemm_amx_w8a8);
  m.impl("gemm_amx_bf16_silu_mul", &gemm_amx_bf16_silu_mul);
  m.impl("gemm_amx_w8a8_silu_mul", &gemm_amx_w8a8_silu_mul);
}

#endif  // AMX
