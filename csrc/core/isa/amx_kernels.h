// The amx_bf16 kernel set's two products, written once over a tile backend: AmxTiles (the
// instructions) or EmulatedTiles (portable, for tests). Operands are bf16 pairs, which is already
// the layout TDPBF16PS wants for both sides: A rows of pairs along the depth, B rows of 16
// column pairs per depth word. Tiles hold 16 rows x 16 words, so the set declares depth_align 16
// (packed depth zero-padded to whole tiles) and row_align 16 (A readable up to a whole tile;
// results of the padding rows are discarded). A product of whole tiles with alpha 1 keeps its
// accumulators in the tiles from C to C; otherwise, and for the indexer's relu and weighted head
// sum, they go through memory to AVX-512.
// Tile registers: 0-3 accumulators, 4-5 A, 6-7 B.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../kernels/kernel_set.h"
#include "row_ops.h"
#include "sets.h"

namespace opmesh::core::kernels {

template <class Tiles>
struct AmxKernels {
  static constexpr int64_t kTileRows = 16;
  static constexpr int64_t kTileWords = 16;

  static void begin_worker() { Tiles::configure(); }
  static void end_worker() { Tiles::release(); }
  // A kernel called outside begin_worker/end_worker configures the tiles itself.
  static void ensure_configured() {
    if (!Tiles::configured()) Tiles::configure();
  }

  // C rows [0, rows) x 16 columns from a float [16][16] accumulator tile.
  static void emit(const float* acc, int64_t rows, float* c, int64_t ldc, const float* row_scale,
                   float alpha) {
    const __m512 scale = _mm512_set1_ps(alpha);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 v = _mm512_mul_ps(scale, _mm512_load_ps(acc + 16 * r));
      if (row_scale != nullptr) {
        v = _mm512_fmadd_ps(_mm512_set1_ps(row_scale[r]), _mm512_loadu_ps(c + r * ldc), v);
      }
      _mm512_storeu_ps(c + r * ldc, v);
    }
  }

  // A block of kR x kC tiles (each 1 or 2) at rows m0, columns n0. With alpha 1 and whole
  // tiles the accumulators start from C (first scaled in place, row by row, where the row scale
  // is not 1; zero without a row scale) and are stored straight back: no pass through memory.
  // Otherwise they start from zero and go through memory to the AVX-512 epilogue.
  template <int kR, int kC>
  static void gemm_block(const GemmArgs& g, int64_t m0, int64_t n0) {
    const uint32_t* a = static_cast<const uint32_t*>(g.a) + m0 * g.lda;
    const uint32_t* b = static_cast<const uint32_t*>(g.b) + n0;
    const int64_t sa = g.lda * 4, sb = g.ldb * 4;
    const int64_t rows0 = std::min<int64_t>(kTileRows, g.m - m0);
    const int64_t rows1 = std::min<int64_t>(kTileRows, g.m - m0 - kTileRows);
    float* c = g.c + m0 * g.ldc + n0;
    const int64_t ldc = g.ldc, sc = g.ldc * 4;
    float* c1 = c + kTileRows * ldc;
    const bool direct = g.alpha == 1.0f && rows0 == kTileRows && (kR == 1 || rows1 == kTileRows);
    if (direct && g.row_scale != nullptr) {
      const float* rs = g.row_scale + m0;
      for (int64_t r = 0; r < kR * kTileRows; ++r) {
        if (rs[r] == 1.0f) continue;
        const __m512 f = _mm512_set1_ps(rs[r]);
        for (int col = 0; col < kC; ++col) {
          float* x = c + r * ldc + 16 * col;
          _mm512_storeu_ps(x, _mm512_mul_ps(f, _mm512_loadu_ps(x)));
        }
      }
      Tiles::template load<0>(c, sc);
      if constexpr (kC > 1) Tiles::template load<1>(c + 16, sc);
      if constexpr (kR > 1) Tiles::template load<2>(c1, sc);
      if constexpr (kR > 1 && kC > 1) Tiles::template load<3>(c1 + 16, sc);
    } else {
      Tiles::template zero<0>();
      if constexpr (kC > 1) Tiles::template zero<1>();
      if constexpr (kR > 1) Tiles::template zero<2>();
      if constexpr (kR > 1 && kC > 1) Tiles::template zero<3>();
    }
    for (int64_t k = 0; k < g.depth; k += kTileWords) {
      Tiles::template load<4>(a + k, sa);
      if constexpr (kR > 1) Tiles::template load<5>(a + kTileRows * g.lda + k, sa);
      Tiles::template load<6>(b + k * g.ldb, sb);
      if constexpr (kC > 1) Tiles::template load<7>(b + k * g.ldb + 16, sb);
      Tiles::template dpbf16<0, 4, 6>();
      if constexpr (kC > 1) Tiles::template dpbf16<1, 4, 7>();
      if constexpr (kR > 1) Tiles::template dpbf16<2, 5, 6>();
      if constexpr (kR > 1 && kC > 1) Tiles::template dpbf16<3, 5, 7>();
    }
    if (direct) {
      Tiles::template store<0>(c, sc);
      if constexpr (kC > 1) Tiles::template store<1>(c + 16, sc);
      if constexpr (kR > 1) Tiles::template store<2>(c1, sc);
      if constexpr (kR > 1 && kC > 1) Tiles::template store<3>(c1 + 16, sc);
      return;
    }
    alignas(64) float acc[kTileRows * 16];
    const float* rs = g.row_scale != nullptr ? g.row_scale + m0 : nullptr;
    Tiles::template store<0>(acc, 64);
    emit(acc, rows0, c, ldc, rs, g.alpha);
    if constexpr (kC > 1) {
      Tiles::template store<1>(acc, 64);
      emit(acc, rows0, c + 16, ldc, rs, g.alpha);
    }
    if constexpr (kR > 1) {
      const float* rs1 = rs != nullptr ? rs + kTileRows : nullptr;
      Tiles::template store<2>(acc, 64);
      emit(acc, rows1, c1, ldc, rs1, g.alpha);
      if constexpr (kC > 1) {
        Tiles::template store<3>(acc, 64);
        emit(acc, rows1, c1 + 16, ldc, rs1, g.alpha);
      }
    }
  }

  static void gemm(const GemmArgs& g) {
    ensure_configured();
    // One step of `ahead` per block of up to 32 x 32.
    LinesAhead ahead(g.ahead, (g.m + 2 * kTileRows - 1) / (2 * kTileRows) * ((g.n + 31) / 32));
    for (int64_t m0 = 0; m0 < g.m; m0 += 2 * kTileRows) {
      const bool two_rows = g.m - m0 > kTileRows;
      for (int64_t n0 = 0; n0 < g.n; n0 += 32) {
        const bool two_cols = g.n - n0 >= 32;
        ahead.next();
        if (two_rows && two_cols) {
          gemm_block<2, 2>(g, m0, n0);
        } else if (two_rows) {
          gemm_block<2, 1>(g, m0, n0);
        } else if (two_cols) {
          gemm_block<1, 2>(g, m0, n0);
        } else {
          gemm_block<1, 1>(g, m0, n0);
        }
      }
    }
  }

  static void score_tile(const ScoreTileArgs& args) {
    ensure_configured();
    const uint32_t* query = static_cast<const uint32_t*>(args.query);
    const uint32_t* key = static_cast<const uint32_t*>(args.key);
    const int64_t depth = args.depth;
    constexpr int64_t kKeyBytes = kKeyTile * 4;
    alignas(64) float acc[kTileRows][kKeyTile];
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t r0 = args.row_begin / kTileRows * kTileRows; r0 < args.row_end; r0 += kTileRows) {
      const int64_t lo = std::max<int64_t>(args.row_begin, r0);
      const int64_t hi = std::min<int64_t>(args.row_end, r0 + kTileRows);
      for (int h = 0; h < args.groups; ++h) {
        const uint32_t* q = query + (h * args.row_capacity + r0) * depth;
        Tiles::template zero<0>();
        Tiles::template zero<1>();
        Tiles::template zero<2>();
        Tiles::template zero<3>();
        for (int64_t k = 0; k < depth; k += kTileWords) {
          const uint32_t* kk = key + k * kKeyTile;
          Tiles::template load<4>(q + k, depth * 4);
          Tiles::template load<6>(kk, kKeyBytes);
          Tiles::template dpbf16<0, 4, 6>();
          Tiles::template load<7>(kk + 16, kKeyBytes);
          Tiles::template dpbf16<1, 4, 7>();
          Tiles::template load<6>(kk + 32, kKeyBytes);
          Tiles::template dpbf16<2, 4, 6>();
          Tiles::template load<7>(kk + 48, kKeyBytes);
          Tiles::template dpbf16<3, 4, 7>();
        }
        Tiles::template store<0>(&acc[0][0], kKeyBytes);
        Tiles::template store<1>(&acc[0][16], kKeyBytes);
        Tiles::template store<2>(&acc[0][32], kKeyBytes);
        Tiles::template store<3>(&acc[0][48], kKeyBytes);
        // relu and the weighted head sum. MAXPS returns its second operand when either is NaN:
        // (zero, acc) lets a NaN through.
        for (int64_t r = lo; r < hi; ++r) {
          const __m512 w = _mm512_set1_ps(args.weights[r * args.groups + h]);
          float* out = args.scores + r * kKeyTile;
          for (int c = 0; c < 4; ++c) {
            const __m512 s = _mm512_max_ps(zero, _mm512_load_ps(&acc[r - r0][16 * c]));
            _mm512_storeu_ps(out + 16 * c, _mm512_fmadd_ps(w, s, _mm512_loadu_ps(out + 16 * c)));
          }
        }
      }
    }
  }
};

// The amx_bf16 kernel set on a tile backend: the two products and the score tile on tiles, the
// rest borrowed from the AVX-512 sets.
template <class Tiles>
KernelSet amx_kernel_set(const char* name) {
  using K = AmxKernels<Tiles>;
  // Decode's scores from keys in place run on the tiles' GEMM (no key_scores).
  return {name,
          Isa::kAmxBf16,
          Word::kBf16Pair,
          /*depth_align=*/16,
          /*row_align=*/16,
          /*row_block=*/16,
          /*block_tiles=*/4,
          &K::begin_worker,
          &K::end_worker,
          &K::gemm,
          &avx512::softmax,
          &avx512::exp_rows,
          &avx512_bf16::to_bf16,
          &avx512::pack_keys,
          &K::score_tile,
          &avx512::widen,
          row_ops(),
          &avx512_bf16::softmax_bf16,
          /*key_scores=*/nullptr,
          /*key_scores_rows=*/0,
          /*pack_widened_keys=*/nullptr,
          /*value_rows=*/nullptr,
          /*gemm_rows=*/nullptr,
          /*decode_block_tiles=*/4};
}

}  // namespace opmesh::core::kernels
