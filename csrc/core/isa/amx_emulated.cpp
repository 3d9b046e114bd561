// The amx_bf16 kernel set on the portable tile emulation: the same kernels as amx_bf16.cpp, so
// their blocking, packing and edge handling are tested on machines without AMX.
#include "amx_kernels.h"
#include "sets.h"
#include "tile_emulation.h"

namespace opmesh::core::kernels::amx_emulated {

const KernelSet& kernel_set() {
  static const KernelSet set = amx_kernel_set<EmulatedTiles>("amx_bf16/emulated");
  return set;
}

}  // namespace opmesh::core::kernels::amx_emulated
