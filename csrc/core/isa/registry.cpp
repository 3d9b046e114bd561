
#include "../kernel_choice.h"
#include "../kernels/kernel_set.h"
#include "sets.h"

namespace opmesh::core::kernels {

const KernelSet& float32_set(Isa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case Isa::kAmxBf16:
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      return avx512::kernel_set();
    case Isa::kAvx2:
      return avx2::kernel_set();
    case Isa::kScalar:
      break;
  }
#else
  (void)isa;
#endif
  return scalar::kernel_set();
}

const KernelSet* find_set(Isa isa, Word word) {
  if (!isa_supported(isa)) return nullptr;
  if (word == Word::kFloat32) return &float32_set(isa);
#if defined(__x86_64__)
  if (isa == Isa::kAvx512Bf16) return &avx512_bf16::kernel_set();
  if (isa == Isa::kAmxBf16) {
    switch (amx_tiles()) {
      case AmxTiles::kEmulated:
        return &amx_emulated::kernel_set();
      case AmxTiles::kHardware:
#if defined(OPMESH_HAVE_AMX)
        return &amx_bf16::kernel_set();
#endif
      case AmxTiles::kNone:
        break;
    }
  }
#endif
  return nullptr;
}

int available_sets(const KernelSet** out, int capacity) {
  int n = 0;
  for (Isa isa : supported_isas()) {
    for (Word word : {Word::kFloat32, Word::kBf16Pair}) {
      const KernelSet* set = find_set(isa, word);
      if (set == nullptr || set->isa != isa || n >= capacity) continue;
      out[n++] = set;
    }
  }
  return n;
}

const KernelSet& select_set(Isa isa, DType dtype, int bf16_pairs, bool compute_bound) {
  if (dtype != DType::kBFloat16 || static_cast<int>(isa) < static_cast<int>(Isa::kAvx512Bf16)) {
    return float32_set(isa);
  }
  const KernelSet* pairs = find_set(isa, Word::kBf16Pair);
  if (pairs == nullptr) return float32_set(isa);
  const bool use_pairs =
      bf16_pairs >= 0 ? bf16_pairs == 1
                      : bf16_pairs_faster(compute_bound ? Work::kCompute : Work::kMemory, isa);
  return use_pairs ? *pairs : float32_set(isa);
}

}  // namespace opmesh::core::kernels
