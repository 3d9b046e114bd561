#include "cpu_features.h"

#include <cstdlib>

#include "errors.h"

namespace opmesh::core {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "unknown";
}

Isa parse_isa(const std::string& name, const char* what) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name == isa_name(isa)) return isa;
  }
  throw ArgumentError(what,
                      "expected one of scalar, avx2, avx512, avx512_bf16, got '" + name + "'");
}

Isa detected_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const Isa detected = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return Isa::kAvx512Bf16;
    if (avx512) return Isa::kAvx512;
    if (avx2) return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return detected;
#else
  return Isa::kScalar;
#endif
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (int level = 0; level <= static_cast<int>(detected_isa()); ++level) {
    out.push_back(static_cast<Isa>(level));
  }
  return out;
}

Isa active_isa() {
  const Isa best = detected_isa();
  const char* cap = std::getenv("OPMESH_SIMD_MAX");
  if (cap == nullptr || *cap == '\0') return best;
  const Isa requested = parse_isa(cap, "OPMESH_SIMD_MAX");
  return static_cast<int>(requested) < static_cast<int>(best) ? requested : best;
}

}  // namespace opmesh::core
