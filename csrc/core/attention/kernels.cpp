#include "kernels.h"

namespace opmesh::core::attention {

Kernels kernels(Isa isa, bool bf16_pairs) {
#if defined(__x86_64__)
  if (bf16_pairs) return kernels_avx512_bf16();
  switch (isa) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      return kernels_avx512();
    case Isa::kAvx2:
      return kernels_avx2();
    case Isa::kScalar:
      break;
  }
#else
  (void)isa;
  (void)bf16_pairs;
#endif
  return kernels_scalar();
}

}  // namespace opmesh::core::attention
