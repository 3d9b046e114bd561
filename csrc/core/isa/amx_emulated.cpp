// The amx_bf16 kernel set on the portable tile emulation: the same kernels as amx_bf16.cpp, so
// their blocking, packing and edge handling are tested on machines without AMX.
#include "amx_kernels.h"
#include "sets.h"
#include "tile_emulation.h"

namespace opmesh::core::kernels::amx_emulated {

const KernelSet& kernel_set() {
  using K = AmxKernels<EmulatedTiles>;
  static const KernelSet set{"amx_bf16/emulated",
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

}  // namespace opmesh::core::kernels::amx_emulated
