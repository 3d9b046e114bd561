// AVX2 + FMA micro-kernel, float32 words. Blocks of 6 rows x 16 keys (12 accumulators) walk the
// 64-key tile in four column passes.
#include <immintrin.h>

#include "../indexer_kernels.h"
#include "row_blocks.h"

namespace opmesh::core::indexer {
namespace {

constexpr int kTile = 64;
constexpr int kCols = 2;  // ymm registers of 8 keys per row

template <int kRows>
inline void block(const float* q, int64_t depth, const float* k, const float* w, int w_stride,
                  float* scores) {
  __m256 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < depth; ++d) {
    const __m256 k0 = _mm256_loadu_ps(k + d * kTile);
    const __m256 k1 = _mm256_loadu_ps(k + d * kTile + 8);
    for (int r = 0; r < kRows; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * depth + d);
      acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();  // max(zero, acc): a NaN dot product stays NaN
  for (int r = 0; r < kRows; ++r) {
    const __m256 wb = _mm256_broadcast_ss(w + r * w_stride);
    for (int c = 0; c < kCols; ++c) {
      float* out = scores + r * kTile + c * 8;
      _mm256_storeu_ps(out,
                       _mm256_fmadd_ps(wb, _mm256_max_ps(zero, acc[r][c]), _mm256_loadu_ps(out)));
    }
  }
}

}  // namespace

void score_tile_avx2_f32(const ScoreTileArgs& args) {
  const float* query = static_cast<const float*>(args.query);
  const float* key = static_cast<const float*>(args.key);
  const int64_t depth = args.depth;
  for (int h = 0; h < args.groups; ++h) {
    const float* qh = query + h * args.row_capacity * depth;
    for (int pass = 0; pass < kTile / (8 * kCols); ++pass) {
      const int col = pass * 8 * kCols;
      for_each_row_block<6>(args.row_begin, args.row_end, [&](auto rows, int r) {
        block<decltype(rows)::value>(qh + r * depth, depth, key + col,
                                     args.weights + r * args.groups + h, args.groups,
                                     args.scores + r * kTile + col);
      });
    }
  }
}

}  // namespace opmesh::core::indexer
