// AVX-512F micro-kernel, float32 words. Blocks of 6 rows x 64 keys: 24 zmm accumulators, 4 key
// vectors and one broadcast fit the 32 registers.
#include <immintrin.h>

#include "../indexer_kernels.h"
#include "row_blocks.h"

namespace opmesh::core::indexer {
namespace {

constexpr int kTile = 64;
constexpr int kCols = 4;

template <int kRows>
inline void block(const float* q, int64_t depth, const float* k, const float* w, int w_stride,
                  float* scores) {
  __m512 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < depth; ++d) {
    const float* kd = k + d * kTile;
    const __m512 k0 = _mm512_load_ps(kd);
    const __m512 k1 = _mm512_load_ps(kd + 16);
    const __m512 k2 = _mm512_load_ps(kd + 32);
    const __m512 k3 = _mm512_load_ps(kd + 48);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r * depth + d]);
      acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qb, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qb, k3, acc[r][3]);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    const __m512 wb = _mm512_set1_ps(w[r * w_stride]);
    for (int c = 0; c < kCols; ++c) {
      float* out = scores + r * kTile + c * 16;
      _mm512_storeu_ps(out,
                       _mm512_fmadd_ps(wb, _mm512_max_ps(acc[r][c], zero), _mm512_loadu_ps(out)));
    }
  }
}

}  // namespace

void score_tile_avx512_f32(const ScoreTileArgs& args) {
  const float* query = static_cast<const float*>(args.query);
  const float* key = static_cast<const float*>(args.key);
  const int64_t depth = args.depth;
  for (int h = 0; h < args.groups; ++h) {
    const float* qh = query + h * args.row_capacity * depth;
    for_each_row_block<6>(args.row_begin, args.row_end, [&](auto rows, int r) {
      block<decltype(rows)::value>(qh + r * depth, depth, key, args.weights + r * args.groups + h,
                                   args.groups, args.scores + r * kTile);
    });
  }
}

}  // namespace opmesh::core::indexer
