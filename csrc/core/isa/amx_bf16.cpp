// The amx_bf16 kernel set on AMX instructions: TDPBF16PS tiles for Q.K^T, P.V and the indexer's
// scores; softmax, bf16 rounding and key packing stay on AVX-512. Built only when the compiler
// accepts -mamx-tile -mamx-bf16, selected only when the CPU and OS allow tiles (cpu_features).
#include "amx_kernels.h"
#include "amx_tiles.h"
#include "sets.h"

namespace opmesh::core::kernels::amx_bf16 {

const KernelSet& kernel_set() {
  static const KernelSet set = amx_kernel_set<AmxTiles>("amx_bf16/tiles");
  return set;
}

}  // namespace opmesh::core::kernels::amx_bf16
