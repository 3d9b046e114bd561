// AVX-512F micro-kernel on float32 words.
#include "avx512_tile.h"

namespace opmesh::core::indexer {
namespace {

struct Float32Policy {
  using Word = float;
  using Vec = __m512;
  static Vec load(const float* p) { return _mm512_load_ps(p); }
  static Vec broadcast(float w) { return _mm512_set1_ps(w); }
  static __m512 madd(__m512 acc, Vec q, Vec k) { return _mm512_fmadd_ps(q, k, acc); }
};

}  // namespace

void score_tile_avx512_f32(const ScoreTileArgs& args) { Avx512Tile<Float32Policy>::run(args); }

}  // namespace opmesh::core::indexer
