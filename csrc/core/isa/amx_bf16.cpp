// The amx_bf16 kernel set on AMX instructions: TDPBF16PS tiles for Q.K^T, P.V and the indexer's
// scores; softmax, bf16 rounding and key packing stay on AVX-512. Built only when the compiler
// accepts -mamx-tile -mamx-bf16, selected only when the CPU and OS allow tiles (cpu_features).
#include "amx_kernels.h"
#include "amx_tiles.h"
#include "sets.h"

namespace opmesh::core::kernels::amx_bf16 {

const KernelSet& kernel_set() {
  using K = AmxKernels<AmxTiles>;
  static const KernelSet set{"amx_bf16/tiles",
                             Isa::kAmxBf16,
                             Word::kBf16Pair,
                             16,
                             16,
                             16,
                             4,
                             &K::begin_worker,
                             &K::end_worker,
                             &K::gemm,
                             &avx512::softmax,
                             &avx512_bf16::to_bf16,
                             &avx512::pack_keys,
                             &K::score_tile,
                             &avx512::widen};
  return set;
}

}  // namespace opmesh::core::kernels::amx_bf16
