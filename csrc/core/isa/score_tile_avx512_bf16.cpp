// AVX-512 BF16 micro-kernel: each 32-bit word holds the bf16 pair (x[2l], x[2l+1]); VDPBF16PS
// multiplies pairs exactly and accumulates in float32, twice the work per instruction of the
// float32 kernel.
#include "avx512_tile.h"

namespace opmesh::core::indexer {
namespace {

struct Bf16PairPolicy {
  using Word = uint32_t;
  using Vec = __m512bh;
  static Vec as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }
  static Vec load(const uint32_t* p) { return as_bh(_mm512_load_si512(p)); }
  static Vec broadcast(uint32_t w) { return as_bh(_mm512_set1_epi32(static_cast<int>(w))); }
  static __m512 madd(__m512 acc, Vec q, Vec k) { return _mm512_dpbf16_ps(acc, q, k); }
};

}  // namespace

void score_tile_avx512_bf16(const ScoreTileArgs& args) { Avx512Tile<Bf16PairPolicy>::run(args); }

}  // namespace opmesh::core::indexer
