#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "errors.h"
#include "names.h"

namespace opmesh::core {

std::string cpu_identity() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned int regs[12] = {};
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  std::string brand;
  if (__get_cpuid(0x80000000u, &eax, &ebx, &ecx, &edx) && eax >= 0x80000004u) {
    for (unsigned int leaf = 0; leaf < 3; ++leaf) {
      __get_cpuid(0x80000002u + leaf, &regs[4 * leaf], &regs[4 * leaf + 1], &regs[4 * leaf + 2],
                  &regs[4 * leaf + 3]);
    }
    char text[49] = {};
    std::memcpy(text, regs, 48);
    brand = text;
    const size_t first = brand.find_first_not_of(' ');
    brand = first == std::string::npos ? std::string() : brand.substr(first);
  }
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return brand.empty() ? "unknown" : brand;
  const unsigned int family = ((eax >> 8) & 0xfu) + ((eax >> 20) & 0xffu);
  const unsigned int model = ((eax >> 4) & 0xfu) | (((eax >> 16) & 0xfu) << 4);
  return brand + " family " + std::to_string(family) + " model " + std::to_string(model) +
         " stepping " + std::to_string(eax & 0xfu);
#else
  return "unknown";
#endif
}

const char* isa_name(Isa isa) {
  static constexpr const char* kNames[] = {"scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16"};
  return enum_name(isa, kNames, "unknown");
}

void require_supported(Isa isa) {
  if (!isa_supported(isa)) {
    throw ArgumentError("isa", std::string(isa_name(isa)) + " is not supported by this CPU");
  }
}

Isa parse_isa(const std::string& name, const char* what) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmxBf16}) {
    if (name == isa_name(isa)) return isa;
  }
  throw ArgumentError(
      what, "expected one of scalar, avx2, avx512, avx512_bf16, amx_bf16, got '" + name + "'");
}

const char* amx_tiles_name(AmxTiles tiles) {
  static constexpr const char* kNames[] = {"none", "hardware", "emulated"};
  return enum_name(tiles, kNames, "none");
}

namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
Isa detected_vector_isa() {
  static const Isa detected = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512dq");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return Isa::kAvx512Bf16;
    if (avx512) return Isa::kAvx512;
    if (avx2) return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return detected;
}

bool amx_usable() {
#if defined(OPMESH_HAVE_AMX) && defined(__linux__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1u;
  const bool amx_tile = (edx >> 24) & 1u;
  const bool osxsave = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 27) & 1u);
  if (!amx_bf16 || !amx_tile || !osxsave) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const unsigned tile_bits = (1u << 17) | (1u << 18);  // XTILECFG, XTILEDATA
  if ((xcr0_lo & tile_bits) != tile_bits) return false;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

}  // namespace

bool amx_hardware() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool usable = detected_vector_isa() == Isa::kAvx512Bf16 && amx_usable();
  return usable;
#else
  return false;
#endif
}

AmxTiles amx_tiles() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const char* env = std::getenv("OPMESH_AMX_TILES");
  const bool emulate = env != nullptr && std::strcmp(env, "emulate") == 0;
  if (env != nullptr && *env != '\0' && !emulate && std::strcmp(env, "auto") != 0) {
    throw ArgumentError("OPMESH_AMX_TILES",
                        std::string("expected auto or emulate, got '") + env + "'");
  }
  if (emulate && detected_vector_isa() == Isa::kAvx512Bf16) return AmxTiles::kEmulated;
  if (amx_hardware()) return AmxTiles::kHardware;
#endif
  return AmxTiles::kNone;
}

Isa detected_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return amx_hardware() ? Isa::kAmxBf16 : detected_vector_isa();
#else
  return Isa::kScalar;
#endif
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  Isa best = detected_isa();
  if (amx_tiles() != AmxTiles::kNone) best = Isa::kAmxBf16;
  for (int level = 0; level <= static_cast<int>(best); ++level) {
    out.push_back(static_cast<Isa>(level));
  }
  return out;
}

bool isa_supported(Isa isa) {
  if (isa == Isa::kAmxBf16) return amx_tiles() != AmxTiles::kNone;
  return static_cast<int>(isa) <= static_cast<int>(detected_isa());
}

Isa active_isa() {
  const Isa best = supported_isas().back();
  const char* cap = std::getenv("OPMESH_SIMD_MAX");
  if (cap == nullptr || *cap == '\0') return best;
  const Isa requested = parse_isa(cap, "OPMESH_SIMD_MAX");
  return static_cast<int>(requested) < static_cast<int>(best) ? requested : best;
}

}  // namespace opmesh::core
