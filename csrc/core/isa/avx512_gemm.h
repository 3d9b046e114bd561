// The AVX-512 flash-attention GEMM, shared by the float32 and the bf16-pair variants. A Policy
// supplies the word type and the multiply-accumulate (see avx512_tile.h for the same contract).
// Blocks of 6 rows x 64 columns: 24 zmm accumulators, 4 B vectors and one broadcast. Included
// only by translation units compiled with AVX-512 flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../kernels/kernel_set.h"
#include "../kernels/row_blocks.h"

namespace opmesh::core::kernels {

template <class Policy>
struct Avx512Gemm {
  using Word = typename Policy::Word;
  using Vec = typename Policy::Vec;

  template <int kRows, int kCols>
  static void block(const Word* a, int64_t lda, const Word* b, int64_t ldb, int64_t depth, float* c,
                    int64_t ldc, const float* row_scale, float alpha) {
    __m512 acc[kRows][kCols];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kCols; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < depth; ++d) {
      Vec bv[kCols];
      for (int j = 0; j < kCols; ++j) bv[j] = Policy::load(b + d * ldb + 16 * j);
      for (int r = 0; r < kRows; ++r) {
        const Vec ab = Policy::broadcast(a[r * lda + d]);
        for (int j = 0; j < kCols; ++j) acc[r][j] = Policy::madd(acc[r][j], ab, bv[j]);
      }
    }
    const __m512 scale = _mm512_set1_ps(alpha);
    for (int r = 0; r < kRows; ++r) {
      float* out = c + r * ldc;
      if (row_scale != nullptr) {
        const __m512 keep = _mm512_set1_ps(row_scale[r]);
        for (int j = 0; j < kCols; ++j) {
          const __m512 old = _mm512_mul_ps(keep, _mm512_loadu_ps(out + 16 * j));
          _mm512_storeu_ps(out + 16 * j, _mm512_fmadd_ps(scale, acc[r][j], old));
        }
      } else {
        for (int j = 0; j < kCols; ++j) {
          _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(scale, acc[r][j]));
        }
      }
    }
  }

  template <int kCols>
  static void columns(const GemmArgs& g, int64_t col) {
    const Word* a = static_cast<const Word*>(g.a);
    const Word* b = static_cast<const Word*>(g.b) + col;
    for_each_row_block<6>(0, static_cast<int>(g.m), [&](auto rows, int r) {
      block<decltype(rows)::value, kCols>(a + r * g.lda, g.lda, b, g.ldb, g.depth,
                                          g.c + r * g.ldc + col, g.ldc,
                                          g.row_scale ? g.row_scale + r : nullptr, g.alpha);
    });
  }

  static void run(const GemmArgs& g) {
    int64_t col = 0;
    for (; col + 64 <= g.n; col += 64) columns<4>(g, col);
    switch ((g.n - col) / 16) {
      case 3:
        columns<3>(g, col);
        break;
      case 2:
        columns<2>(g, col);
        break;
      case 1:
        columns<1>(g, col);
        break;
      default:
        break;
    }
  }
};

}  // namespace opmesh::core::kernels
