// AVX-512 BF16 micro-kernel: each 32-bit word holds the bf16 pair (x[2l], x[2l+1]); VDPBF16PS
// multiplies pairs exactly and accumulates in float32, twice the work per instruction of the
// float32 kernel. Blocks of 6 rows x 64 keys.
#include <immintrin.h>

#include <cstdint>

#include "../indexer_kernels.h"
#include "row_blocks.h"

namespace opmesh::core::indexer {
namespace {

constexpr int kTile = 64;
constexpr int kCols = 4;

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

template <int kRows>
inline void block(const uint32_t* q, int64_t depth, const uint32_t* k, const float* w, int w_stride,
                  float* scores) {
  __m512 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < depth; ++d) {
    const uint32_t* kd = k + d * kTile;
    const __m512bh k0 = as_bh(_mm512_load_si512(kd));
    const __m512bh k1 = as_bh(_mm512_load_si512(kd + 16));
    const __m512bh k2 = as_bh(_mm512_load_si512(kd + 32));
    const __m512bh k3 = as_bh(_mm512_load_si512(kd + 48));
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * depth + d])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qb, k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qb, k3);
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

void score_tile_avx512_bf16(const ScoreTileArgs& args) {
  const uint32_t* query = static_cast<const uint32_t*>(args.query);
  const uint32_t* key = static_cast<const uint32_t*>(args.key);
  const int64_t depth = args.depth;
  for (int h = 0; h < args.groups; ++h) {
    const uint32_t* qh = query + h * args.row_capacity * depth;
    for_each_row_block<6>(args.row_begin, args.row_end, [&](auto rows, int r) {
      block<decltype(rows)::value>(qh + r * depth, depth, key, args.weights + r * args.groups + h,
                                   args.groups, args.scores + r * kTile);
    });
  }
}

}  // namespace opmesh::core::indexer
