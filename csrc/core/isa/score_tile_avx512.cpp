// AVX-512F micro-kernel on float32 words.
#include "avx512_policies.h"
#include "avx512_tile.h"

namespace opmesh::core::indexer {
void score_tile_avx512_f32(const ScoreTileArgs& args) { Avx512Tile<isa::Float32Policy>::run(args); }

}  // namespace opmesh::core::indexer
