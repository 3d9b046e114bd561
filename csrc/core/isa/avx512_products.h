// The AVX-512 products, shared by the float32 and the bf16-pair variants: the flash-attention
// GEMM (Avx512Gemm) and the indexer's score tile (Avx512Tile). A Policy supplies the word type
// and the multiply-accumulate:
//   using Word;                                    // 4-byte packed element(s)
//   using Vec;                                     // 16 words in a register
//   static Vec load(const Word* p);                // 16 consecutive words
//   static Vec broadcast(Word w);                  // one word in every lane
//   static __m512 madd(__m512 acc, Vec q, Vec k);  // acc += q * k, per lane, in float32
// Both work in blocks of 6 rows x 64 columns: 24 zmm accumulators, 4 B (key) vectors and one
// broadcast fit the 32 registers (the GEMM on one column vector: 12 rows). Their loops over rows
// and columns are unrolled by pragma: otherwise GCC keeps the accumulator array on the stack
// around the depth loop (zeroed, loaded, stored and loaded again per block). Included only by
// translation units compiled with AVX-512 flags.
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

  // Rows: row r of A at a(r) (strided or gathered).
  template <int kRows, int kCols, class Rows>
  static void block(const Rows& a, const Word* b, int64_t ldb, int64_t depth, float* c, int64_t ldc,
                    const float* row_scale, float alpha) {
    const Word* row[kRows];
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) row[r] = a(r);
    __m512 acc[kRows][kCols];
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < kCols; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < depth; ++d) {
      Vec bv[kCols];
#pragma GCC unroll 16
      for (int j = 0; j < kCols; ++j) bv[j] = Policy::load(b + d * ldb + 16 * j);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const Vec ab = Policy::broadcast(row[r][d]);
#pragma GCC unroll 16
        for (int j = 0; j < kCols; ++j) acc[r][j] = Policy::madd(acc[r][j], ab, bv[j]);
      }
    }
    const __m512 scale = _mm512_set1_ps(alpha);
    if (row_scale != nullptr) {
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        float* out = c + r * ldc;
        const __m512 keep = _mm512_set1_ps(row_scale[r]);
#pragma GCC unroll 16
        for (int j = 0; j < kCols; ++j) {
          const __m512 old = _mm512_mul_ps(keep, _mm512_loadu_ps(out + 16 * j));
          _mm512_storeu_ps(out + 16 * j, _mm512_fmadd_ps(scale, acc[r][j], old));
        }
      }
      return;
    }
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
      for (int j = 0; j < kCols; ++j) {
        _mm512_storeu_ps(c + r * ldc + 16 * j, _mm512_mul_ps(scale, acc[r][j]));
      }
    }
  }

  // Row r of A: a_rows[r] when given (gathered rows), else g.a + r * g.lda.
  template <int kCols>
  static void columns(const GemmArgs& g, const Word* const* a_rows, int64_t col,
                      LinesAhead& ahead) {
    const Word* a = static_cast<const Word*>(g.a);
    const Word* b = static_cast<const Word*>(g.b) + col;
    // One column vector leaves a 6-row block 6 independent accumulators, too few to hide the
    // product's latency: such blocks take up to 12 rows.
    constexpr int kBlockRows = kCols == 1 ? 12 : 6;
    for_each_even_row_block<kBlockRows>(0, static_cast<int>(g.m), [&](auto rows, int r) {
      ahead.next();
      float* c = g.c + r * g.ldc + col;
      const float* scale = g.row_scale ? g.row_scale + r : nullptr;
      if (a_rows != nullptr) {
        block<decltype(rows)::value, kCols>([&](int i) { return a_rows[r + i]; }, b, g.ldb, g.depth,
                                            c, g.ldc, scale, g.alpha);
      } else {
        block<decltype(rows)::value, kCols>([&](int i) { return a + (r + i) * g.lda; }, b, g.ldb,
                                            g.depth, c, g.ldc, scale, g.alpha);
      }
    });
  }

  static void run(const GemmArgs& g, const Word* const* a_rows = nullptr) {
    // One step of `ahead` per block: at most 6 rows (12 on one column vector) of 64 columns.
    const int64_t row_blocks = (g.m + 5) / 6 * ((g.n + 63) / 64);
    LinesAhead ahead(g.ahead, row_blocks);
    int64_t col = 0;
    for (; col + 64 <= g.n; col += 64) columns<4>(g, a_rows, col, ahead);
    switch ((g.n - col) / 16) {
      case 3:
        columns<3>(g, a_rows, col, ahead);
        break;
      case 2:
        columns<2>(g, a_rows, col, ahead);
        break;
      case 1:
        columns<1>(g, a_rows, col, ahead);
        break;
      default:
        break;
    }
  }

  // gemm_rows: A's rows gathered.
  static void run_rows(const void* const* a_rows, const GemmArgs& g) {
    run(g, reinterpret_cast<const Word* const*>(a_rows));
  }
};

template <class Policy>
struct Avx512Tile {
  using Word = typename Policy::Word;
  using Vec = typename Policy::Vec;
  static constexpr int kTile = 64;
  static constexpr int kCols = 4;

  template <int kRows>
  static void block(const Word* q, int64_t depth, const Word* k, const float* w, int w_stride,
                    float* scores) {
    __m512 acc[kRows][kCols];
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < depth; ++d) {
      const Word* kd = k + d * kTile;
      const Vec k0 = Policy::load(kd);
      const Vec k1 = Policy::load(kd + 16);
      const Vec k2 = Policy::load(kd + 32);
      const Vec k3 = Policy::load(kd + 48);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const Vec qb = Policy::broadcast(q[r * depth + d]);
        acc[r][0] = Policy::madd(acc[r][0], qb, k0);
        acc[r][1] = Policy::madd(acc[r][1], qb, k1);
        acc[r][2] = Policy::madd(acc[r][2], qb, k2);
        acc[r][3] = Policy::madd(acc[r][3], qb, k3);
      }
    }
    // relu and the weighted head sum while the dot products are still in registers. MAXPS
    // returns its second operand when either is NaN: (zero, acc) lets a NaN through.
    const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const __m512 wb = _mm512_set1_ps(w[r * w_stride]);
#pragma GCC unroll 16
      for (int c = 0; c < kCols; ++c) {
        float* out = scores + r * kTile + c * 16;
        _mm512_storeu_ps(out,
                         _mm512_fmadd_ps(wb, _mm512_max_ps(zero, acc[r][c]), _mm512_loadu_ps(out)));
      }
    }
  }

  static void run(const ScoreTileArgs& args) {
    const Word* query = static_cast<const Word*>(args.query);
    const Word* key = static_cast<const Word*>(args.key);
    const int64_t depth = args.depth;
    for (int h = 0; h < args.groups; ++h) {
      const Word* qh = query + h * args.row_capacity * depth;
      for_each_even_row_block<6>(args.row_begin, args.row_end, [&](auto rows, int r) {
        block<decltype(rows)::value>(qh + r * depth, depth, key, args.weights + r * args.groups + h,
                                     args.groups, args.scores + r * kTile);
      });
    }
  }
};

}  // namespace opmesh::core::kernels
