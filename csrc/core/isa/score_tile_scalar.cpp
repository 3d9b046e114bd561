// Portable micro-kernel: plain loops the compiler may vectorise for the baseline target.
#include <algorithm>

#include "../indexer_kernels.h"
#include "../indexer_tiling.h"

namespace opmesh::core::indexer {

void score_tile_scalar_f32(const ScoreTileArgs& args) {
  const float* query = static_cast<const float*>(args.query);
  const float* key = static_cast<const float*>(args.key);
  float dot[kKeyTile];
  for (int h = 0; h < args.groups; ++h) {
    for (int r = args.row_begin; r < args.row_end; ++r) {
      const float* q = query + (h * args.row_capacity + r) * args.depth;
      std::fill(dot, dot + kKeyTile, 0.0f);
      for (int64_t d = 0; d < args.depth; ++d) {
        const float qd = q[d];
        const float* k = key + d * kKeyTile;
        for (int j = 0; j < kKeyTile; ++j) dot[j] += qd * k[j];
      }
      const float w = args.weights[r * args.groups + h];
      float* out = args.scores + r * kKeyTile;
      for (int j = 0; j < kKeyTile; ++j) out[j] += w * std::max(dot[j], 0.0f);
    }
  }
}

}  // namespace opmesh::core::indexer
