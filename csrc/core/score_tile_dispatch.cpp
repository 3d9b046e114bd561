#include "indexer_kernels.h"

namespace opmesh::core::indexer {

ScoreTileFn score_tile_fn(Isa isa, bool bf16_pairs) {
#if defined(__x86_64__)
  if (bf16_pairs) return isa == Isa::kAvx512Bf16 ? &score_tile_avx512_bf16 : nullptr;
  switch (isa) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      return &score_tile_avx512_f32;
    case Isa::kAvx2:
      return &score_tile_avx2_f32;
    case Isa::kScalar:
      return &score_tile_scalar_f32;
  }
  return nullptr;
#else
  (void)isa;
  return bf16_pairs ? nullptr : &score_tile_scalar_f32;
#endif
}

}  // namespace opmesh::core::indexer
