// AVX-512 BF16 micro-kernel: each 32-bit word holds the bf16 pair (x[2l], x[2l+1]); VDPBF16PS
// multiplies pairs exactly and accumulates in float32, twice the work per instruction of the
// float32 kernel.
#include "avx512_policies.h"
#include "avx512_tile.h"

namespace opmesh::core::indexer {
void score_tile_avx512_bf16(const ScoreTileArgs& args) {
  Avx512Tile<isa::Bf16PairPolicy>::run(args);
}

}  // namespace opmesh::core::indexer
